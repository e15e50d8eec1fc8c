"""The worker core over remote parameter-server shards: :class:`RemoteShardTier`.

:class:`RemoteShardTier` is an :class:`EmbeddingWorker` whose shards are
``RemoteParameterServer`` clients, with an asynchronous gradient pusher and a bounded queue,
checkpoint orchestration across shards, and its counters (:class:`WorkerStats`). The
``embedding-worker`` service (:mod:`embedding_store.worker_service`) is its gRPC front end.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_all
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
    checkpoint_publish,
)
from embedding_store.batch import Batch
from embedding_store.checkpoint_task import CheckpointTask
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import (
    CheckpointError,
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import answered_in_http1
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import Optimizer, optimizer_from_dict
from embedding_store.ps_client import RemoteParameterServer, ShardStatus
from embedding_store.tier import CLEAR_REASON, ProgressCallback, TierStatus
from embedding_store.worker import (
    BackwardStats,
    EmbeddingWorker,
    IdFeature,
    LookupResult,
    checked_features,
)

log = logging.getLogger(__name__)

#: Builds the client of shard ``index`` at ``address``. The default connects a
#: :class:`RemoteParameterServer`; tests pass fakes with the same methods.
ShardClientFactory = Callable[[str, int], RemoteParameterServer]

#: How long the pusher sends a batch's update again to a shard that cannot be reached (a
#: restarting shard) before it counts the push as failed: the trainers' lookups ride out the
#: same outage (training.ctx.TIER_RETRY_SECONDS), and their run goes on once it is back.
PUSH_RETRY_SECONDS = 30.0

#: Deadline of each shard's Status call while :meth:`RemoteShardTier.wait_for_serving` polls.
SERVING_POLL_TIMEOUT_SECONDS = 2.0

#: True once whoever asked for a dump or load is gone (its deadline passed, it disconnected):
#: the task then stops before it changes anything (see :meth:`RemoteShardTier.dump`).
CallerGone = Callable[[], bool]


@dataclass(frozen=True)
class WorkerStats:
    """Counters of a :class:`RemoteShardTier` since it started, and its queues now.

    ``*_lookups`` count lookup calls answered; ``*_ids`` the ID occurrences of their ID
    features (before hash stacking and deduplication); "eval" covers every ``train=False``
    lookup (eval and inference). ``unknown_ids`` are IDs answered with zeros (see
    :attr:`LookupResult.unknown_ids`). The gradient counters count what the pusher applied:
    batches, unique rows sent to the shards, rows dropped for NaN/Inf, and batches whose push
    failed (their gradients are lost on the shards that failed, and applied on the others:
    nothing is rolled back; :meth:`RemoteShardTier.flush` reports them).
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
    (``shard_timeout``), so the queue always drains: a push to a shard that cannot be reached
    is sent again for up to :data:`PUSH_RETRY_SECONDS` (it never left: a restarting shard
    gets it once back), and one that still fails, or fails in flight, is counted and
    reported by :meth:`flush`; the shards that answered keep
    their part of that batch, and the pusher goes on only once every shard's call ended.

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
                return RemoteParameterServer(
                    address,
                    replica_index=index,
                    replica_size=len(shard_addresses),
                    timeout=shard_timeout,
                    update_retry_seconds=PUSH_RETRY_SECONDS,
                )

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
        # Why lookups are refused: a shard keyed by another embedding config, found by the
        # last verify_shards (the worker's readiness check, every 2 s); None: they are not.
        self._refusal: str | None = None
        self._pusher = threading.Thread(target=self._push_loop, name="gradient-pusher", daemon=True)
        self._pusher.start()

    # ------------------------------------------------------------------ readiness
    def verify_shards(self, *, timeout: float | None = None) -> list[ShardStatus]:
        """Check that shard i answers as replica i of N; raises naming the first mismatch or
        the first shard that does not answer (within ``timeout`` s each; None: the shard
        timeout). The shards are asked at once, so a dead one costs one deadline, not N.
        Returns what each shard reported, in replica order."""
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
                    f"replica {index} of {size} (check the order of the shard addresses: "
                    "the worker's --ps, or serve's --embedding-ps)"
                )
            reported = status.embedding_config
            if reported is None:
                continue  # a shard that predates the field
            config = self.embedding_config
            shared = [name for name in config.slot_names if name in reported.slots_config]
            # Slots the shard lacks may be new (configs roll out one process at a time); a
            # shared slot keyed otherwise reads, and trains, other rows for every ID.
            problems = checkpoint_load.slot_mismatches(
                config, reported, shared, saved_as="at this worker", config_as="at the shard"
            )
            if problems:
                self._refusal = (
                    f"parameter server {client.address} (shard {index}) keys its rows by "
                    f"another embedding config: {'; '.join(problems[:8])}"
                    + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                    + " (give the shards and the workers one embedding_config.yml)"
                )
                raise InvalidArgumentError(self._refusal)
        self._refusal = None
        return statuses

    def wait_for_serving(self, timeout: float, *, serving: bool = True) -> None:
        """Block until every shard answers as its replica and serves (an inference shard
        has loaded its checkpoint; with ``serving=False`` answering is enough): a server
        started before its shards, or while they load, waits for them as it waits for an
        embedding worker. UnavailableError naming the shards still waited for after
        ``timeout`` s; a shard at the wrong place in the list (or a process that is no
        shard) fails at once, as waiting would not change it."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                statuses = self.verify_shards(
                    timeout=max(0.05, min(remaining, SERVING_POLL_TIMEOUT_SECONDS))
                )
            except (UnavailableError, DeadlineExceededError) as error:
                if answered_in_http1(error.message):  # an HTTP port: waiting would not help
                    raise
                last = error.message
            else:
                waiting = [
                    f"{client.peer}" + (f" ({status.task})" if status.task else "")
                    for client, status in zip(self.clients, statuses, strict=True)
                    if serving and not status.serving
                ]
                if not waiting:
                    return
                last = "not serving yet: " + ", ".join(waiting)
            if time.monotonic() >= deadline:
                raise UnavailableError(f"embedding shards not serving after {timeout:g} s ({last})")
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ lookups
    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        features = batch.id_type_features if isinstance(batch, Batch) else checked_features(batch)
        refusal = self._refusal
        if refusal is not None:
            # Its rows would read as unknown (zeros) and train other rows: not served until
            # a check finds the shards right again.
            raise UnavailableError(refusal)
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

    def drop_forward_contexts(self, refs: Sequence[int]) -> None:
        """Drop the contexts of train lookups ``refs`` abandoned without a backward (the
        worker core is in this process: no call to the shards)."""
        self.worker.drop_forward_contexts(refs)

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
        # In the caller's context: a shard client reads its caller's deadline there.
        futures = [
            pool.submit(contextvars.copy_context().run, task, client) for client in self.clients
        ]
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
        futures = [
            pool.submit(contextvars.copy_context().run, task, client) for client in self.clients
        ]
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
        # Rows dropped, as by a load: a backward for a lookup made before (or while the
        # shards clear) would move the fresh rows by stale gradients; refused, before and
        # after (worker.take_forward_context says why).
        self.worker.invalidate_forward_contexts(CLEAR_REASON)
        try:
            self._each(lambda c: c.clear())
        finally:
            self.worker.invalidate_forward_contexts(CLEAR_REASON)

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
    ) -> checkpoint_manifest.EmbeddingManifest:
        """Every shard writes its part into a staging directory; the worker then writes the
        manifest and the done-marker and renames the directory into place. If a shard fails,
        nothing is published (no manifest, no done-marker) and the error names the shard.
        If ``caller_gone()`` is true just before the rename (the RPC's caller gave up), the
        staging directory is removed and nothing is published either. The manifest names
        the optimizer of the shards that have one; shards keeping state of different
        optimizers fail the dump (:func:`_manifest_optimizer`).
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
    ) -> checkpoint_manifest.EmbeddingManifest:
        self._wait_for_gradients(f"dump to {directory}")
        target = Path(directory).absolute()
        checkpoint_publish.check_embedding_target(target, overwrite=overwrite)
        staging = checkpoint_publish.staging_directory_for(target)
        total = len(self.clients)
        done = 0
        lock = threading.Lock()
        try:
            progress("dump", 0, total)

            def dump_one(
                client: RemoteParameterServer,
            ) -> tuple[list[checkpoint_manifest.FileEntry], dict[str, Any] | None]:
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
            optimizer = _manifest_optimizer(target, results)
            checkpoint_dump.finalize_checkpoint(
                staging, self.embedding_config, total, entries, optimizer
            )
            # The point of no return: a caller told that the dump failed (its deadline passed)
            # must not find the checkpoint published later.
            _raise_if_caller_gone(caller_gone, f"dump to {target}", "nothing was published")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        checkpoint_publish.publish_directory(staging, target, overwrite=overwrite)
        return checkpoint_manifest.read_manifest(target)

    def load(
        self,
        directory: str | os.PathLike,
        *,
        progress: ProgressCallback | None = None,
        caller_gone: CallerGone | None = None,
    ) -> checkpoint_manifest.EmbeddingManifest:
        """Verify the whole checkpoint, every shard's capacity and the saved optimizer state
        each shard would keep (as its own load checks it), then have every shard load
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
    ) -> checkpoint_manifest.EmbeddingManifest:
        self._wait_for_gradients(f"load of {directory}")
        target = Path(directory).absolute()
        manifest = checkpoint_manifest.read_manifest(target)
        checkpoint_load.check_compatible(manifest, self.embedding_config)
        total = len(self.clients)
        progress("load", 0, total)
        # Check everything before any shard changes: every file's checksum (a verified pass
        # that keeps only each shard's row count) and every shard's capacity. The shards then
        # load in parallel, each all-or-nothing; what is left to fail is a shard going away.
        statuses = self.shard_statuses()
        counts = checkpoint_load.count_rows_per_replica(
            manifest, total, [_load_receiver(manifest, status) for status in statuses]
        )
        for index, (rows, status) in enumerate(zip(counts, statuses, strict=True)):
            if rows > status.capacity:
                raise CheckpointError(
                    f"embedding checkpoint {target} gives shard {index} "
                    f"({self.clients[index].address}) {rows} rows, more than its capacity "
                    f"{status.capacity}"
                )
        _raise_if_caller_gone(caller_gone, f"load of {target}", "no shard changed")
        # The shards' rows change from here: a backward for a lookup made before (or while
        # they load) would apply gradients computed against the old rows to the loaded ones.
        # Refused (worker.take_forward_context says why), before and after the shards load.
        reason = f"the load of embedding checkpoint {target}"
        self.worker.invalidate_forward_contexts(reason)
        try:
            # Each shard reads the checkpoint itself (its own files, or every file when the
            # count differs, keeping the rows it owns) and swaps them in only once all are
            # read: never a clear() followed by a stream that a failure or a killed worker
            # cuts short.
            self._each(
                lambda c: c.load(str(target), caller_gone=caller_gone), self._checkpoint_executor
            )
        finally:
            self.worker.invalidate_forward_contexts(reason)
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
            forward_buffer_size=self.worker.forward_buffer_size,
            shard_addresses=self.shard_addresses,
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


def _manifest_optimizer(
    target: Path,
    results: Sequence[tuple[Sequence[checkpoint_manifest.FileEntry], dict[str, Any] | None]],
) -> dict[str, Any] | None:
    """The optimizer a dump's manifest names, from the shards' answers (each its files and
    its optimizer's settings, None when it has none): the first one any shard has.

    Not shard 0's alone: a shard restarted empty has no optimizer (and writes no rows), and
    a manifest naming none makes every load drop the other shards' optimizer state, with no
    warning (state is kept only for the optimizer the manifest names). Shards that keep
    state of different layouts (another kind of optimizer, Adagrad with and without
    ``vectorwise_shared``, or rows without state beside rows with it) would make a
    checkpoint whose state no load could keep (:func:`checkpoint_load.state_fits`): refused,
    naming them, before anything is published."""
    layouts: dict[str, list[int]] = {}
    for index, (files, optimizer) in enumerate(results):
        if optimizer:
            layout = checkpoint_load.optimizer_summary(optimizer)
        elif any(entry.rows for entry in files):
            layout = "no optimizer"
        else:
            continue  # no optimizer and no rows (restarted empty): nothing to keep
        layouts.setdefault(layout, []).append(index)
    if len(layouts) > 1:
        which = "; ".join(
            f"{layout} on shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))}"
            for layout, shards in layouts.items()
        )
        raise CheckpointError(
            f"checkpoint {target} not written (no manifest, no done-marker): the shards keep "
            f"the state of different optimizers ({which}), which no load could keep; "
            "configure every shard with one optimizer and dump again"
        )
    return next((optimizer for _, optimizer in results if optimizer), None)


def _load_receiver(
    manifest: checkpoint_manifest.EmbeddingManifest, status: ShardStatus
) -> Optimizer | None:
    """The optimizer whose state a shard's Load keeps: its own, else (a training shard not
    configured yet) the checkpoint's, which it adopts; None for an inference shard without
    one, or when the shard reports settings this build cannot read (its own load checks
    them then)."""
    try:
        if status.optimizer:
            return optimizer_from_dict(status.optimizer)
    except (ConfigError, ValueError):
        return None
    return None if status.read_only else checkpoint_load.optimizer_of(manifest)


def _caller_waits() -> bool:
    """The :data:`CallerGone` of a direct call: its caller waits for the answer."""
    return False


def _raise_if_caller_gone(caller_gone: CallerGone, task: str, outcome: str) -> None:
    """Stop a dump or load whose caller gave up, before it changes anything."""
    if caller_gone():
        raise DeadlineExceededError(
            f"{task} abandoned: its caller gave up (deadline passed or cancelled); {outcome}"
        )


__all__ = ["RemoteShardTier", "WorkerStats"]
