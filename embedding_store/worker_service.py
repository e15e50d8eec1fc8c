"""The ``embedding-worker`` service: the worker core over remote parameter-server shards.

:class:`RemoteShardTier` is the core object: an :class:`EmbeddingWorker` whose shards are
``RemoteParameterServer`` clients, an asynchronous gradient pusher with a bounded queue, and
checkpoint orchestration across shards. :class:`EmbeddingWorkerServicer` only decodes gRPC
requests, calls it, and encodes answers. :func:`serve_embedding_worker` runs the process, with
health checking, server reflection and (``metrics_port``) Prometheus metrics
(:class:`EmbeddingWorkerMetrics`, names prefixed ``recserve_worker_``).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_all
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedding_store import checkpoint
from embedding_store.batch import Batch
from embedding_store.checkpoint_task import CheckpointTask
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.gc_tuning import freeze_long_lived_objects, space_out_young_collections
from embedding_store.grpc_common import (
    LIVENESS_SERVICE,
    add_servicer,
    rpc_errors,
    rpc_stream_errors,
    server_interceptors,
    server_options,
)
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import configure_request_to_settings
from embedding_store.optimizers import Optimizer
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import RemoteParameterServer, ShardStatus
from embedding_store.ps_service import format_address
from embedding_store.rpc_metrics import observed, observed_stream, rpc_metrics
from embedding_store.stop_signal import StopRequest
from embedding_store.tier import ProgressCallback, TierStatus
from embedding_store.worker import (
    BackwardStats,
    EmbeddingWorker,
    IdFeature,
    LookupResult,
    checked_features,
)
from embedding_store.worker_wire import check_answer_fits, pack_slots, unpack_grads

log = logging.getLogger(__name__)

SERVICE_NAME = "recserve.embedding.v1.EmbeddingWorker"
#: Health service that is SERVING while the worker reaches every shard (checked every 2 s).
SHARDS_SERVICE = "recserve.shards"

#: Builds the client of shard ``index`` at ``address``. The default connects a
#: :class:`RemoteParameterServer`; tests pass fakes with the same methods.
ShardClientFactory = Callable[[str, int], RemoteParameterServer]

#: True once whoever asked for a dump or load is gone (its deadline passed, it disconnected):
#: the task then stops before it changes anything (see :meth:`RemoteShardTier.dump`).
CallerGone = Callable[[], bool]

#: How often a serving worker checks that it still reaches every shard (its readiness).
SHARD_CHECK_INTERVAL_SECONDS = 2.0
#: Deadline of each shard's Status call in that check (at most the worker's shard timeout).
SHARD_CHECK_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class WorkerStats:
    """Counters of a :class:`RemoteShardTier` since it started, and its queues now.

    ``*_lookups`` count lookup calls answered; ``*_ids`` the ID occurrences of their ID
    features (before hash stacking and deduplication); "eval" covers every ``train=False``
    lookup (eval and inference). ``unknown_ids`` are IDs answered with zeros (see
    :attr:`LookupResult.unknown_ids`). The gradient counters count what the pusher applied:
    batches, unique rows sent to the shards, rows dropped for NaN/Inf, and batches whose push
    failed (their gradients are lost; :meth:`RemoteShardTier.flush` reports them).
    """

    train_lookups: int
    eval_lookups: int
    train_ids: int
    eval_ids: int
    unknown_ids: int
    gradient_batches_pushed: int
    gradient_rows_pushed: int
    nonfinite_rows_skipped: int
    failed_gradient_pushes: int
    pending_gradient_batches: int
    pending_forward_contexts: int


class RemoteShardTier:
    """Worker core + remote shards + asynchronous gradient pushes (bounded staleness).

    ``backward`` claims the forward context, enqueues the gradients and returns at once; one
    pusher thread scatters them and sends them to the shards in order. At most
    ``forward_buffer_size`` gradient batches wait; a further ``backward`` blocks until one
    leaves (backpressure instead of unbounded memory). Every shard call has a deadline
    (``shard_timeout``), so the queue always drains: a push to a dead shard fails after the
    deadline, is counted, and is reported by :meth:`flush`.

    One checkpoint task (dump or load) runs at a time; :meth:`status` reports it and its
    progress, along with what each shard reports. ``connect(address, index)`` builds the
    shard clients (default: :class:`RemoteParameterServer` with ``shard_timeout``).
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        shard_addresses: Sequence[str],
        *,
        forward_buffer_size: int = 1000,
        shard_timeout: float = 10.0,
        connect: ShardClientFactory | None = None,
    ) -> None:
        if not shard_addresses:
            raise InvalidArgumentError("an embedding worker needs at least one --ps address")
        if connect is None:

            def connect(address: str, index: int) -> RemoteParameterServer:
                return RemoteParameterServer(address, replica_index=index, timeout=shard_timeout)

        self.embedding_config = embedding_config
        self.shard_addresses = tuple(shard_addresses)
        self.clients = [connect(address, i) for i, address in enumerate(shard_addresses)]
        self._executor = ThreadPoolExecutor(
            max_workers=max(2, len(self.clients)), thread_name_prefix="shard-call"
        )
        # Shard dumps and loads take long: their own threads keep lookups, pushes and status
        # calls (which use self._executor) answering while one runs.
        self._checkpoint_executor = ThreadPoolExecutor(
            max_workers=len(self.clients), thread_name_prefix="shard-checkpoint"
        )
        # Readiness checks too: a hung shard's status call must not hold a thread that a
        # lookup is waiting for.
        self._status_executor = ThreadPoolExecutor(
            max_workers=len(self.clients), thread_name_prefix="shard-status"
        )
        self.worker = EmbeddingWorker(
            embedding_config,
            self.clients,
            forward_buffer_size=forward_buffer_size,
            executor=self._executor,
            deduplicate=True,
        )
        self._gradients: queue.Queue = queue.Queue(maxsize=forward_buffer_size)
        # Counters (WorkerStats): lookups run on many RPC threads, pushes on the pusher.
        self._stats_lock = threading.Lock()
        self._lookups = {True: 0, False: 0}
        self._ids = {True: 0, False: 0}
        self._unknown_ids = 0
        self._batches_pushed = 0
        self._rows_pushed = 0
        self._nonfinite_rows_skipped = 0
        self._failed_pushes_total = 0
        self._failed_pushes = 0  # since the last flush
        self._last_push_error: str | None = None
        # The checkpoint task run through this tier ("", "dumping", "loading") and its progress.
        self._checkpoint_task = CheckpointTask("embedding worker")
        self._pusher = threading.Thread(target=self._push_loop, name="gradient-pusher", daemon=True)
        self._pusher.start()

    # ------------------------------------------------------------------ readiness
    def verify_shards(self, *, timeout: float | None = None) -> None:
        """Check that shard i answers as replica i of N; raises naming the first mismatch or
        the first shard that does not answer (within ``timeout`` s each; None: the shard
        timeout). The shards are asked at once, so a dead one costs one deadline, not N."""
        size = len(self.clients)
        if timeout is None:
            statuses = self._each(lambda c: c.status(), self._status_executor)
        else:
            statuses = self._each(lambda c: c.status(timeout=timeout), self._status_executor)
        for index, (client, status) in enumerate(zip(self.clients, statuses, strict=True)):
            if status.replica_index != index or status.replica_size != size:
                raise InvalidArgumentError(
                    f"parameter server {client.address} answers as replica "
                    f"{status.replica_index} of {status.replica_size}, but was given as "
                    f"replica {index} of {size} (check the order of --ps addresses)"
                )

    # ------------------------------------------------------------------ lookups
    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        features = batch.id_type_features if isinstance(batch, Batch) else checked_features(batch)
        result = self.worker.lookup(features, train=train)
        ids = sum(len(feature.values) for feature in features)  # a loop over slots, not IDs
        with self._stats_lock:
            self._lookups[train] += 1
            self._ids[train] += ids
            self._unknown_ids += result.unknown_ids
        return result

    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        """Queue the gradients of forward ``ref`` for the pusher; blocks while
        ``forward_buffer_size`` batches wait. The forward context is claimed here, so lookups
        made while the batch waits cannot expire it, and an unknown ``ref`` fails at once
        (NotFoundError). Rows are counted when pushed (:meth:`stats`), hence zeros here."""
        # Checked now, so a bad gradient fails this call (and leaves the context for a
        # corrected one), not the pusher's later push.
        context = self.worker.take_forward_context(ref, grads)
        self._gradients.put((context, grads))
        return BackwardStats(rows_pushed=0, nonfinite_rows_skipped=0)

    def _push_loop(self) -> None:
        while True:
            item = self._gradients.get()
            try:
                if item is None:
                    return
                context, grads = item
                stats = self.worker.apply_gradients(context, grads)
                with self._stats_lock:
                    self._batches_pushed += 1
                    self._rows_pushed += stats.rows_pushed
                    self._nonfinite_rows_skipped += stats.nonfinite_rows_skipped
            except Exception as error:  # keep pushing later batches; report on flush
                message = getattr(error, "message", repr(error))
                with self._stats_lock:
                    self._failed_pushes += 1
                    self._failed_pushes_total += 1
                    self._last_push_error = message
                log.warning("gradient push failed: %s", message)
            finally:
                self._gradients.task_done()

    def flush(self) -> None:
        """Wait until every queued gradient batch was applied or failed (each push has the
        shard deadline); raise UnavailableError if any failed since the last flush.

        Trainers flush (TrainCtx after its updates): the report is theirs. With several
        trainers on one worker (DDP ranks), the next one to flush gets it, whichever rank
        pushed the batch; the job then stops as one. Administration (dump, load, clear)
        waits for the queue without taking the report (:meth:`_wait_for_gradients`)."""
        self._gradients.join()
        with self._stats_lock:
            failed, last = self._failed_pushes, self._last_push_error
            self._failed_pushes, self._last_push_error = 0, None
        if failed:
            raise UnavailableError(
                f"{failed} gradient batch(es) could not be applied since the last flush; "
                f"last error: {last}"
            )

    def _wait_for_gradients(self, task: str) -> None:
        """Wait until every queued gradient batch was applied or failed, before ``task``. A
        failure stays for the trainers' next flush (were it taken here, the trainer whose
        update was lost would train on, told nothing); it is logged."""
        self._gradients.join()
        with self._stats_lock:
            failed, last = self._failed_pushes, self._last_push_error
        if failed:
            log.warning(
                "%s: %d gradient batch(es) could not be applied since the trainers last "
                "flushed (they are told at their next flush); last error: %s",
                task,
                failed,
                last,
            )

    @property
    def pending_gradient_batches(self) -> int:
        """Gradient batches queued for the pusher (not counting the one being pushed)."""
        return self._gradients.qsize()

    def stats(self) -> WorkerStats:
        """Counters and queue lengths; no shard is asked (cheap enough for every scrape)."""
        with self._stats_lock:
            return WorkerStats(
                train_lookups=self._lookups[True],
                eval_lookups=self._lookups[False],
                train_ids=self._ids[True],
                eval_ids=self._ids[False],
                unknown_ids=self._unknown_ids,
                gradient_batches_pushed=self._batches_pushed,
                gradient_rows_pushed=self._rows_pushed,
                nonfinite_rows_skipped=self._nonfinite_rows_skipped,
                failed_gradient_pushes=self._failed_pushes_total,
                pending_gradient_batches=self.pending_gradient_batches,
                pending_forward_contexts=self.worker.pending_backward,
            )

    # ------------------------------------------------------------------ administration
    def _each(
        self,
        task: Callable[[RemoteParameterServer], object],
        executor: ThreadPoolExecutor | None = None,
    ) -> list:
        """``task(client)`` for every shard at once; results in replica order.

        Waits for every call (each has its shard deadline) before raising the first failure
        in replica order, so no shard is still at work when the caller cleans up after it.
        """
        pool = executor or self._executor
        futures = [pool.submit(task, client) for client in self.clients]
        wait_for_all(futures)
        return [future.result() for future in futures]

    def _each_settled(
        self,
        task: Callable[[RemoteParameterServer], object],
        executor: ThreadPoolExecutor | None = None,
    ) -> list:
        """Like :meth:`_each`, with each shard's RecserveError in its place instead of
        raised (anything else still raises)."""
        pool = executor or self._executor
        futures = [pool.submit(task, client) for client in self.clients]
        wait_for_all(futures)
        answers: list = []
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, RecserveError):
                raise error
            answers.append(error if error is not None else future.result())
        return answers

    def configure(
        self,
        *,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        self._each(lambda c: c.configure(optimizer=optimizer, initialization=initialization))

    def clear(self) -> None:
        self._wait_for_gradients("clear")
        self._each(lambda c: c.clear())

    def _tracked(self, progress: ProgressCallback | None) -> ProgressCallback:
        """A progress callback that records the fraction for :meth:`status`, then calls
        ``progress``: a caller told of a step finds it in the status already."""

        def report(stage: str, done: int, total: int) -> None:
            self._checkpoint_task.set_progress(done, total)
            if progress:
                progress(stage, done, total)

        return report

    def dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        progress: ProgressCallback | None = None,
        caller_gone: CallerGone | None = None,
    ) -> checkpoint.EmbeddingManifest:
        """Every shard writes its part into a staging directory; the worker then writes the
        manifest and the done-marker and renames the directory into place. If a shard fails,
        nothing is published (no manifest, no done-marker) and the error names the shard.
        If ``caller_gone()`` is true just before the rename (the RPC's caller gave up), the
        staging directory is removed and nothing is published either.
        UnavailableError while another dump or load runs."""
        self._checkpoint_task.begin("dumping")
        try:
            return self._dump(
                directory,
                overwrite=overwrite,
                progress=self._tracked(progress),
                caller_gone=caller_gone or _caller_waits,
            )
        finally:
            self._checkpoint_task.end()

    def _dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool,
        progress: ProgressCallback,
        caller_gone: CallerGone,
    ) -> checkpoint.EmbeddingManifest:
        self._wait_for_gradients(f"dump to {directory}")
        target = Path(directory).absolute()
        checkpoint.check_target(target, overwrite=overwrite)
        staging = checkpoint.staging_directory_for(target)
        total = len(self.clients)
        done = 0
        lock = threading.Lock()
        try:
            progress("dump", 0, total)

            def dump_one(
                client: RemoteParameterServer,
            ) -> tuple[list[checkpoint.FileEntry], dict[str, Any] | None]:
                nonlocal done
                result = client.dump(str(staging))
                with lock:
                    done += 1
                    progress("dump", done, total)
                return result

            try:
                results = self._each(dump_one, self._checkpoint_executor)
            except RecserveError as error:  # the shard client's message names the shard
                raise type(error)(
                    f"checkpoint {target} not written (no manifest, no done-marker): "
                    f"{error.message}"
                ) from None
            entries = [entry for files, _ in results for entry in files]
            optimizer = results[0][1]
            checkpoint.finalize_checkpoint(
                staging, self.embedding_config, total, entries, optimizer
            )
            # The point of no return: a caller told that the dump failed (its deadline passed)
            # must not find the checkpoint published later.
            _raise_if_caller_gone(caller_gone, f"dump to {target}", "nothing was published")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        checkpoint.publish_directory(staging, target, overwrite=overwrite)
        return checkpoint.read_manifest(target)

    def load(
        self,
        directory: str | os.PathLike,
        *,
        progress: ProgressCallback | None = None,
        caller_gone: CallerGone | None = None,
    ) -> checkpoint.EmbeddingManifest:
        """Verify the whole checkpoint and every shard's capacity, then have every shard load
        its part (Load RPC): with the same shard count it reads its own files, with another
        count it reads them all and keeps the rows it owns. Each shard replaces its rows only
        once it has read all of them, so a failure (or a killed worker) leaves every shard
        that did not finish with its previous rows, never empty or half-filled. A shard
        without an optimizer takes the checkpoint's, with the saved optimizer state.

        ``caller_gone``: checked before any shard changes, and passed on to the shards' loads
        (a shard abandons its load while it still reads); the caller of a load that gave up
        finds the tier as it was. UnavailableError while another dump or load runs."""
        self._checkpoint_task.begin("loading")
        try:
            return self._load(
                directory,
                progress=self._tracked(progress),
                caller_gone=caller_gone or _caller_waits,
            )
        finally:
            self._checkpoint_task.end()

    def _load(
        self, directory: str | os.PathLike, *, progress: ProgressCallback, caller_gone: CallerGone
    ) -> checkpoint.EmbeddingManifest:
        self._wait_for_gradients(f"load of {directory}")
        target = Path(directory).absolute()
        manifest = checkpoint.read_manifest(target)
        checkpoint.check_compatible(manifest, self.embedding_config)
        total = len(self.clients)
        progress("load", 0, total)
        # Check everything before any shard changes: every file's checksum (a verified pass
        # that keeps only each shard's row count) and every shard's capacity. The shards then
        # load in parallel, each all-or-nothing; what is left to fail is a shard going away.
        statuses = self.shard_statuses()
        counts = checkpoint.count_rows_per_replica(manifest, total)
        for index, (rows, status) in enumerate(zip(counts, statuses, strict=True)):
            if rows > status.capacity:
                raise checkpoint.CheckpointError(
                    f"embedding checkpoint {target} gives shard {index} "
                    f"({self.clients[index].address}) {rows} rows, more than its capacity "
                    f"{status.capacity}"
                )
        _raise_if_caller_gone(caller_gone, f"load of {target}", "no shard changed")
        # Each shard reads the checkpoint itself (its own files, or every file when the count
        # differs, keeping the rows it owns) and swaps them in only once all are read: never a
        # clear() followed by a stream that a failure or a killed worker cuts short.
        self._each(
            lambda c: c.load(str(target), caller_gone=caller_gone), self._checkpoint_executor
        )
        progress("load", total, total)
        return manifest

    def status(self, *, partial: bool = False) -> TierStatus:
        """Rows, capacity and task of every shard (asked now), this tier's queues and task.

        A shard that does not answer raises, naming it; with ``partial``, it is reported in
        ``shard_errors`` instead (zeros in its other fields) and the others still are."""
        if partial:
            answers = self._each_settled(lambda c: c.status(), self._status_executor)
            errors = tuple("" if isinstance(a, ShardStatus) else a.message for a in answers)
            statuses = [a if isinstance(a, ShardStatus) else _NO_ANSWER for a in answers]
        else:
            statuses, errors = self.shard_statuses(), ()
        task, task_progress = self._checkpoint_task.state()
        return TierStatus(
            rows_per_shard=tuple(s.rows for s in statuses),
            capacity_per_shard=tuple(s.capacity for s in statuses),
            pending_backward=self.worker.pending_backward,
            pending_gradient_batches=self.pending_gradient_batches,
            nonfinite_rows_skipped=self.worker.nonfinite_rows_skipped,
            shard_tasks=tuple(s.task for s in statuses),
            shard_task_progress=tuple(s.task_progress for s in statuses),
            task=task,
            task_progress=task_progress,
            shard_serving=tuple(s.serving for s in statuses),
            shard_checkpoint_versions=tuple(s.checkpoint_version for s in statuses),
            shard_errors=errors,
        )

    def shard_statuses(self) -> list[ShardStatus]:
        return self._each(lambda c: c.status())

    def close(self) -> None:
        self._gradients.put(None)
        self._pusher.join(timeout=10)
        for client in self.clients:
            client.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._checkpoint_executor.shutdown(wait=False, cancel_futures=True)
        self._status_executor.shutdown(wait=False, cancel_futures=True)


#: The status reported for a shard that did not answer (``shard_errors`` says why).
_NO_ANSWER = ShardStatus(
    replica_index=0, replica_size=0, rows=0, capacity=0, read_only=False, job_type="",
    optimizer_json="", serving=False, lookups=0, ids_looked_up=0, misses=0, evictions=0,
    task="", task_progress=0.0,
)  # fmt: skip


def _caller_waits() -> bool:
    """The :data:`CallerGone` of a direct call: its caller waits for the answer."""
    return False


def _raise_if_caller_gone(caller_gone: CallerGone, task: str, outcome: str) -> None:
    """Stop a dump or load whose caller gave up, before it changes anything."""
    if caller_gone():
        raise DeadlineExceededError(
            f"{task} abandoned: its caller gave up (deadline passed or cancelled); {outcome}"
        )


# --------------------------------------------------------------------------- metrics
class _WorkerCollector(Collector):
    """Tier counters read from :meth:`RemoteShardTier.stats` at scrape time (exact, no drift)."""

    def __init__(self, tier: RemoteShardTier) -> None:
        self._tier = tier

    def collect(self) -> Iterator[Metric]:
        stats = self._tier.stats()

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            return CounterMetricFamily(f"recserve_worker_{name}", doc, value=value)

        def by_mode(name: str, doc: str, train: int, eval_: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"recserve_worker_{name}", doc, labels=["mode"])
            family.add_metric(["train"], train)
            family.add_metric(["eval"], eval_)
            return family

        def gauge(name: str, doc: str, value: int) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"recserve_worker_{name}", doc, value=value)

        yield by_mode(
            "lookups",
            "Lookup calls answered, by mode (eval: every train=false lookup, eval and inference).",
            stats.train_lookups,
            stats.eval_lookups,
        )
        yield by_mode(
            "ids_looked_up",
            "ID occurrences of the looked-up batches (before hash stacking and deduplication).",
            stats.train_ids,
            stats.eval_ids,
        )
        yield counter(
            "unknown_ids",
            "IDs answered with zeros: unknown to eval/infer lookups, or not admitted by train "
            "lookups (per distinct ID of a lookup).",
            stats.unknown_ids,
        )
        yield counter(
            "gradient_batches_pushed",
            "Gradient batches applied on the shards.",
            stats.gradient_batches_pushed,
        )
        yield counter(
            "gradient_rows_pushed",
            "Unique embedding rows whose gradients were sent to the shards.",
            stats.gradient_rows_pushed,
        )
        yield counter(
            "nonfinite_gradient_rows_skipped",
            "Embedding rows whose gradient had NaN/Inf, dropped instead of pushed.",
            stats.nonfinite_rows_skipped,
        )
        yield counter(
            "failed_gradient_pushes",
            "Gradient batches whose push failed (lost; reported by the next Flush).",
            stats.failed_gradient_pushes,
        )
        yield gauge(
            "pending_gradient_batches",
            "Gradient batches queued for the shards (at most forward_buffer_size).",
            stats.pending_gradient_batches,
        )
        yield gauge(
            "pending_forward_contexts",
            "Train lookups whose Backward has not arrived yet.",
            stats.pending_forward_contexts,
        )


class EmbeddingWorkerMetrics:
    """The Prometheus metrics of one embedding worker, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency, self.errors = rpc_metrics(
            self.registry,
            "recserve_worker",
            "EmbeddingWorker",
            "server side; Dump/Load: whole stream",
        )

    def watch_tier(self, tier: RemoteShardTier) -> None:
        self.registry.register(_WorkerCollector(tier))


# --------------------------------------------------------------------------- servicer
class EmbeddingWorkerServicer(pb_grpc.EmbeddingWorkerServicer):
    """gRPC front end of :class:`RemoteShardTier`: decode, call, encode (and time it)."""

    def __init__(
        self, tier: RemoteShardTier, *, metrics: EmbeddingWorkerMetrics | None = None
    ) -> None:
        self.tier = tier
        self.metrics = metrics or EmbeddingWorkerMetrics()
        self.metrics.watch_tier(tier)

    @rpc_errors
    @observed
    def Lookup(
        self, request: pb.WorkerLookupRequest, context: grpc.ServicerContext
    ) -> pb.WorkerLookupResponse:
        batch = Batch.from_bytes(request.batch)
        check_answer_fits(batch, self.tier.embedding_config)
        result = self.tier.lookup(batch, train=request.train)
        response = pb.WorkerLookupResponse(ref=result.ref or 0, unknown_ids=result.unknown_ids)
        pack_slots(response.slots, result.slots)
        return response

    @rpc_errors
    @observed
    def Backward(
        self, request: pb.BackwardRequest, context: grpc.ServicerContext
    ) -> pb.BackwardResponse:
        stats = self.tier.backward(request.ref, unpack_grads(request.grads))
        return pb.BackwardResponse(
            rows_queued=stats.rows_pushed, nonfinite_rows_skipped=stats.nonfinite_rows_skipped
        )

    @rpc_errors
    @observed
    def Flush(self, request: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        self.tier.flush()
        return pb.FlushResponse()

    @rpc_errors
    @observed
    def Configure(
        self, request: pb.ConfigureRequest, context: grpc.ServicerContext
    ) -> pb.ConfigureResponse:
        optimizer, initialization = configure_request_to_settings(request)
        self.tier.configure(optimizer=optimizer, initialization=initialization)
        return pb.ConfigureResponse()

    @rpc_stream_errors
    @observed_stream
    def Dump(
        self, request: pb.WorkerDumpRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Progress]:
        if not request.directory:
            raise InvalidArgumentError("WorkerDumpRequest.directory must not be empty")
        yield from _with_progress(
            lambda progress: self.tier.dump(
                request.directory,
                overwrite=request.overwrite,
                progress=progress,
                caller_gone=lambda: not context.is_active(),
            ),
            f"dumped to {request.directory}",
        )

    @rpc_stream_errors
    @observed_stream
    def Load(
        self, request: pb.WorkerLoadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Progress]:
        if not request.directory:
            raise InvalidArgumentError("WorkerLoadRequest.directory must not be empty")
        yield from _with_progress(
            lambda progress: self.tier.load(
                request.directory,
                progress=progress,
                caller_gone=lambda: not context.is_active(),
            ),
            f"loaded {request.directory}",
        )

    @rpc_errors
    @observed
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        self.tier.clear()
        return pb.ClearResponse()

    @rpc_errors
    @observed
    def Status(
        self, request: pb.WorkerStatusRequest, context: grpc.ServicerContext
    ) -> pb.WorkerStatusResponse:
        status = self.tier.status(partial=True)  # `embedding-tier status` shows every shard
        size = len(status.rows_per_shard)
        return pb.WorkerStatusResponse(
            shards=list(self.tier.shard_addresses),
            shard_status=[
                pb.ShardStatusResponse(
                    replica_index=i,
                    replica_size=size,
                    rows=rows,
                    capacity=capacity,
                    task=task,
                    task_progress=task_progress,
                    serving=serving,
                    checkpoint_version=version,
                )
                for i, (rows, capacity, task, task_progress, serving, version) in enumerate(
                    zip(
                        status.rows_per_shard,
                        status.capacity_per_shard,
                        status.shard_tasks,
                        status.shard_task_progress,
                        status.shard_serving,
                        status.shard_checkpoint_versions or ("",) * size,
                        strict=True,
                    )
                )
            ],
            pending_backward=status.pending_backward,
            pending_gradient_batches=status.pending_gradient_batches,
            nonfinite_rows_skipped=status.nonfinite_rows_skipped,
            task=status.task,
            task_progress=status.task_progress,
            shard_errors=list(status.shard_errors),
        )


def _with_progress(
    run: Callable[[ProgressCallback], checkpoint.EmbeddingManifest], final_message: str
) -> Iterator[pb.Progress]:
    """Run ``run(progress)`` in a thread and stream its progress reports as they come."""
    updates: queue.Queue = queue.Queue()
    outcome: dict[str, object] = {}

    def progress(stage: str, done: int, total: int) -> None:
        updates.put(pb.Progress(stage=stage, done=done, total=total))

    def target() -> None:
        try:
            outcome["manifest"] = run(progress)
        except BaseException as error:
            outcome["error"] = error
        finally:
            updates.put(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while (update := updates.get()) is not None:
        yield update
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    manifest = outcome["manifest"]
    yield pb.Progress(
        stage="done",
        done=manifest.total_rows,  # type: ignore[attr-defined]
        total=manifest.total_rows,  # type: ignore[attr-defined]
        message=final_message,
    )


def serve_embedding_worker(
    embedding_config: EmbeddingConfig,
    shard_addresses: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    forward_buffer_size: int = 1000,
    shard_timeout: float = 10.0,
    startup_timeout: float = 60.0,
    grace_seconds: float = 5.0,
) -> int:
    """Run the worker service until SIGTERM/SIGINT; returns the exit code (0 when drained).

    Prints ``embedding worker listening on HOST:PORT`` (flushed) once bound, preceded by
    ``embedding worker metrics on http://HOST:M/metrics`` when ``metrics_port`` is given
    (0: a free port); None serves no metrics. Readiness (health ``""`` and the service's
    name) is SERVING while the worker reaches every shard, checked every
    :data:`SHARD_CHECK_INTERVAL_SECONDS`.
    """
    for name, value in (("startup_timeout", startup_timeout), ("grace_seconds", grace_seconds)):
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    tier = RemoteShardTier(
        embedding_config,
        shard_addresses,
        forward_buffer_size=forward_buffer_size,
        shard_timeout=shard_timeout,
    )
    metrics = EmbeddingWorkerMetrics()
    server = grpc.server(
        ThreadPoolExecutor(max_workers=8, thread_name_prefix="worker-rpc"),
        options=server_options(),
        interceptors=server_interceptors(),
    )
    add_servicer(server, EmbeddingWorkerServicer(tier, metrics=metrics), "EmbeddingWorker")
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME, SHARDS_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["EmbeddingWorker"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    metrics_httpd = None
    try:
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
            if bound == 0:
                raise UnavailableError(f"cannot listen on {host}:{port}")
            if metrics_port is not None:
                metrics_httpd = _start_metrics_server(metrics, host, metrics_port)
                print(
                    f"embedding worker metrics on "
                    f"http://{format_address(host, metrics_httpd.server_port)}/metrics",
                    flush=True,
                )
            server.start()
        except BaseException:
            server.stop(0)
            tier.close()
            raise
        freeze_long_lived_objects()  # see embedding_store.gc_tuning: no ~100 ms full collections
        space_out_young_collections()
        print(f"embedding worker listening on {host}:{bound}", flush=True)
        return _serve(
            tier,
            server,
            health_servicer,
            shard_addresses,
            startup_timeout,
            grace_seconds,
            check_timeout=min(SHARD_CHECK_TIMEOUT_SECONDS, shard_timeout),
        )
    finally:
        if metrics_httpd is not None:
            metrics_httpd.shutdown()
            metrics_httpd.server_close()


def _start_metrics_server(metrics: EmbeddingWorkerMetrics, host: str, port: int) -> WSGIServer:
    """Serve ``metrics.registry`` on http://HOST:PORT/metrics (a thread); returns the server."""
    try:
        httpd, _thread = start_http_server(port, addr=host.strip("[]"), registry=metrics.registry)
    except OSError as error:
        raise UnavailableError(
            f"cannot serve metrics on {format_address(host, port)}: {error}"
        ) from None
    return httpd


class _Readiness:
    """The worker's health statuses.

    ``""`` and :data:`SERVICE_NAME` (readiness): SERVING from the moment the worker first
    reached every shard until it shuts down. Not while a shard is away: every worker and
    server shares the shards, so readiness that followed them would empty the workers'
    Service while one shard restarts, and requests for the other shards would fail too.
    :data:`SHARDS_SERVICE`: SERVING while every shard answered at the last check, for
    operators and alerts. After :meth:`shut_down` all stay NOT_SERVING.
    """

    def __init__(self, health_servicer: health.HealthServicer) -> None:
        self._health = health_servicer
        self._lock = threading.Lock()
        self._shards_reachable = False
        self._shut_down = False

    def start(self) -> None:
        """Every shard was reached: ready, for good (until :meth:`shut_down`)."""
        with self._lock:
            if self._shut_down:
                return
            self._shards_reachable = True
            for name in ("", SERVICE_NAME, SHARDS_SERVICE):
                self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def set_shards_reachable(self, reachable: bool) -> bool:
        """Report whether every shard answered; whether that changed the status."""
        with self._lock:
            if self._shut_down or reachable == self._shards_reachable:
                return False
            self._shards_reachable = reachable
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if reachable
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            self._health.set(SHARDS_SERVICE, status)
            return True

    def shut_down(self) -> None:
        with self._lock:
            self._shut_down = True
            self._shards_reachable = False
            for name in ("", SERVICE_NAME, SHARDS_SERVICE):
                self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def _watch_shards(
    tier: RemoteShardTier, readiness: _Readiness, stop: threading.Event, timeout: float
) -> None:
    """Until ``stop``: every :data:`SHARD_CHECK_INTERVAL_SECONDS`, ask every shard's status
    (one deadline of ``timeout`` s for all) and set :data:`SHARDS_SERVICE` by the answer: a
    shard killed or unreachable turns it NOT_SERVING, its return SERVING again."""
    while not stop.wait(SHARD_CHECK_INTERVAL_SECONDS):
        try:
            tier.verify_shards(timeout=timeout)
        except RecserveError as error:
            if readiness.set_shards_reachable(False):
                log.warning(
                    "a shard is away (lookups that need it fail until it is back): %s",
                    error.message,
                )
        except Exception:  # the watcher must outlive any surprise; report it
            log.exception("checking the shards failed")
            readiness.set_shards_reachable(False)
        else:
            if readiness.set_shards_reachable(True):
                log.info("embedding worker reaches every shard again")


def _serve(
    tier: RemoteShardTier,
    server: grpc.Server,
    health_servicer: health.HealthServicer,
    shard_addresses: Sequence[str],
    startup_timeout: float,
    grace_seconds: float,
    check_timeout: float = SHARD_CHECK_TIMEOUT_SECONDS,
) -> int:
    """Wait for the shards, serve until SIGTERM/SIGINT (re-checking the shards in the
    background for readiness), drain; returns the exit code."""
    # The handlers only flag the request (StopRequest); the Event, which other threads wait
    # on, is set from this thread.
    requested = StopRequest()
    requested.install()
    stop = threading.Event()

    deadline = time.monotonic() + startup_timeout
    while not requested.requested:
        try:
            tier.verify_shards()
            break
        except (UnavailableError, DeadlineExceededError) as error:
            if time.monotonic() > deadline:
                log.error("shards not reachable within %.0f s: %s", startup_timeout, error)
                server.stop(0)
                tier.close()
                return 1
            requested.wait(0.2)
        except RecserveError as error:
            log.error("%s", error.message)
            print(f"embedding worker: error: {error.message}", file=sys.stderr, flush=True)
            server.stop(0)
            tier.close()
            return 1
    readiness = _Readiness(health_servicer)
    watcher = None
    if not requested.requested:  # a SIGTERM during the wait: to the drain, never SERVING
        readiness.start()
        log.info("embedding worker serving %d shard(s): %s", len(shard_addresses), shard_addresses)
        watcher = threading.Thread(
            target=_watch_shards,
            args=(tier, readiness, stop, check_timeout),
            name="shard-readiness",
            daemon=True,
        )
        watcher.start()
        requested.wait()
    stop.set()  # the shard watcher's cue
    readiness.shut_down()
    server.stop(grace_seconds).wait()
    if watcher is not None:
        watcher.join(timeout=check_timeout + 1.0)  # its last check has a deadline
    return _flush_and_close(tier)


def _flush_and_close(tier: RemoteShardTier) -> int:
    """Push the gradients still queued, close the tier; the worker's exit code: 1 when some
    never reached their shard (lost training is not a clean exit), else 0."""
    code = 0
    try:
        tier.flush()
    except RecserveError as error:
        log.error("on shutdown: %s", error.message)
        code = 1
    tier.close()
    return code


__all__ = [
    "SERVICE_NAME",
    "SHARDS_SERVICE",
    "EmbeddingWorkerMetrics",
    "EmbeddingWorkerServicer",
    "RemoteShardTier",
    "WorkerStats",
    "serve_embedding_worker",
]
