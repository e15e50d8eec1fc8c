"""The ``embedding-worker`` service: the gRPC front end of :class:`RemoteShardTier`.

:class:`RemoteShardTier` (:mod:`embedding_store.remote_tier`) is the core object: the worker
core over remote parameter-server shards. :class:`EmbeddingWorkerServicer` only decodes gRPC
requests, calls it, and encodes answers. :func:`serve_embedding_worker` runs the process, with
health checking, server reflection and (``metrics_port``) Prometheus metrics
(:class:`~embedding_store.worker_metrics.EmbeddingWorkerMetrics`, names prefixed
``recserve_worker_``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from embedding_store import checkpoint_manifest
from embedding_store.batch import Batch
from embedding_store.config import EmbeddingConfig, embedding_config_to_mapping
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.gc_tuning import freeze_long_lived_objects, space_out_young_collections
from embedding_store.grpc_common import (
    LIVENESS_SERVICE,
    WORKER_SERVICE,
    add_health_servicer,
    add_servicer,
    announce,
    answered_in_http1,
    bind_tier_port,
    format_address,
    rpc_errors,
    rpc_stream_errors,
    server_interceptors,
    server_options,
)
from embedding_store.optimizer_wire import configure_request_to_settings
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import ShardStatus, caller_deadline
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.rpc_metrics import observed, observed_stream, unauthenticated_counter
from embedding_store.stop_signal import StopRequest
from embedding_store.tier import DownReasons, ProgressCallback
from embedding_store.worker import warm_up_kernels
from embedding_store.worker_metrics import EmbeddingWorkerMetrics, start_metrics_server
from embedding_store.worker_wire import (
    check_answer_fits,
    encode_unknown_per_sample,
    pack_slots,
    unpack_grads,
)

log = logging.getLogger(__name__)

SERVICE_NAME = WORKER_SERVICE
#: Health service that is SERVING while the worker reaches every shard (checked every 2 s).
SHARDS_SERVICE = "recserve.shards"

#: How often a serving worker checks that it still reaches every shard (its readiness).
SHARD_CHECK_INTERVAL_SECONDS = 2.0
#: Deadline of each shard's Status call in that check (at most the worker's shard timeout).
SHARD_CHECK_TIMEOUT_SECONDS = 2.0
#: How long before its caller's deadline a lookup's shard calls end (at most; a tenth of the
#: caller's time when shorter): the worker's answer naming a hung shard must still arrive.
LOOKUP_ANSWER_MARGIN_SECONDS = 0.25


class EmbeddingWorkerServicer(pb_grpc.EmbeddingWorkerServicer):
    """gRPC front end of :class:`RemoteShardTier`: decode, call, encode (and time it)."""

    def __init__(
        self, tier: RemoteShardTier, *, metrics: EmbeddingWorkerMetrics | None = None
    ) -> None:
        self.tier = tier
        self.metrics = metrics or EmbeddingWorkerMetrics()
        self.metrics.watch_tier(tier)
        # Sent with every Status: servers check it against their checkpoint's config. Keys
        # in the config's order, never sorted: the slots' order gives their ID prefixes.
        self._config_json = json.dumps(embedding_config_to_mapping(tier.embedding_config))

    @rpc_errors
    @observed
    def Lookup(
        self, request: pb.WorkerLookupRequest, context: grpc.ServicerContext
    ) -> pb.WorkerLookupResponse:
        batch = Batch.from_bytes(request.batch)
        check_answer_fits(batch, self.tier.embedding_config)
        if request.drop_refs:  # the caller's abandoned train lookups (no Backward coming)
            self.tier.drop_forward_contexts(request.drop_refs)
        with _within_callers_deadline(context):
            result = self.tier.lookup(batch, train=request.train)
        response = pb.WorkerLookupResponse(
            ref=result.ref or 0,
            unknown_ids=result.unknown_ids,
            unknown_per_sample=encode_unknown_per_sample(result),
        )
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
        with _within_callers_deadline(context):  # a hung shard is then named, as in Lookup
            status = self.tier.status(partial=True)  # `embedding-tier status`: every shard
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
            embedding_config_json=self._config_json,
            forward_buffer_size=status.forward_buffer_size,
        )


@contextlib.contextmanager
def _within_callers_deadline(context: grpc.ServicerContext) -> Iterator[None]:
    """Within: shard lookups and status calls end before the caller's deadline (less
    :data:`LOOKUP_ANSWER_MARGIN_SECONDS`, or a tenth of its time when shorter), so a shard
    that hangs is named to the caller (DEADLINE_EXCEEDED from here, or its error in a
    partial status) instead of the caller's own deadline passing on this worker: a server's
    --lookup-timeout (5 s) is shorter than the worker's --shard-timeout (10 s)."""
    remaining = context.time_remaining()
    if remaining is None:
        yield
        return
    margin = min(LOOKUP_ANSWER_MARGIN_SECONDS, 0.1 * remaining)
    token = caller_deadline.set(time.monotonic() + remaining - margin)
    try:
        yield
    finally:
        caller_deadline.reset(token)


def _with_progress(
    run: Callable[[ProgressCallback], checkpoint_manifest.EmbeddingManifest], final_message: str
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
        interceptors=server_interceptors(unauthenticated_counter(metrics.errors)),
    )
    add_servicer(server, EmbeddingWorkerServicer(tier, metrics=metrics), "EmbeddingWorker")
    health_servicer = health.HealthServicer()
    add_health_servicer(health_servicer, server)
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
            # format_address: an IPv6 host in brackets ("::1:0" is no address to gRPC).
            bound = bind_tier_port(server, format_address(host, port))
            if metrics_port is not None:
                metrics_httpd = start_metrics_server(metrics, host, metrics_port)
                announce(
                    f"embedding worker metrics on "
                    f"http://{format_address(host, metrics_httpd.server_port)}/metrics"
                )
            server.start()
            # Before SERVING (health says NOT_SERVING meanwhile, liveness SERVING): a fresh
            # worker's first lookup and backward must not compile kernels.
            warm_up_kernels(embedding_config)
        except BaseException:
            server.stop(0)
            tier.close()
            raise
        freeze_long_lived_objects()  # see embedding_store.gc_tuning: no ~100 ms full collections
        space_out_young_collections()
        announce(f"embedding worker listening on {format_address(host, bound)}")
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


class _Readiness:
    """The worker's health statuses.

    ``""`` and :data:`SERVICE_NAME` (readiness): SERVING from the moment the worker first
    reached every shard until it shuts down. Not while a shard is away: every worker and
    server shares the shards, so readiness that followed them would empty the workers'
    Service while one shard restarts, and requests for the other shards would fail too.
    :data:`SHARDS_SERVICE`: SERVING while every shard answered and served at the last check
    (as a server's ``recserve_embedding_tier_serving``), for operators and alerts: a shard
    that answers but cannot serve yet (an inference shard loading its checkpoint, a training
    shard not configured yet) fails every lookup that reaches it. After :meth:`shut_down`
    all stay NOT_SERVING.
    """

    def __init__(self, health_servicer: health.HealthServicer) -> None:
        self._health = health_servicer
        self._lock = threading.Lock()
        self._shards_serving = False
        self._shut_down = False

    def start(self, shards_serving: bool = True) -> None:
        """Every shard was reached: ready, for good (until :meth:`shut_down`);
        :data:`SHARDS_SERVICE` says ``shards_serving`` (whether each of them serves)."""
        with self._lock:
            if self._shut_down:
                return
            self._shards_serving = shards_serving
            for name in ("", SERVICE_NAME, SHARDS_SERVICE):
                serving = shards_serving or name != SHARDS_SERVICE
                self._health.set(name, _health_status(serving))

    def set_shards_serving(self, serving: bool) -> bool:
        """Report whether every shard answered and served; whether that changed the status."""
        with self._lock:
            if self._shut_down or serving == self._shards_serving:
                return False
            self._shards_serving = serving
            self._health.set(SHARDS_SERVICE, _health_status(serving))
            return True

    def shut_down(self) -> None:
        with self._lock:
            self._shut_down = True
            self._shards_serving = False
            for name in ("", SERVICE_NAME, SHARDS_SERVICE):
                self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def _health_status(serving: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def _cannot_serve_yet(tier: RemoteShardTier, statuses: Sequence[ShardStatus]) -> str | None:
    """Which shards answered ``statuses`` (replica order) but do not serve, with what they
    are busy with: ``"shard 1 (h:7001) cannot serve yet (loading)"``, one
    per shard joined by ``"; "``; None when every one serves."""
    waiting = [
        f"shard {index} ({client.address}) cannot serve yet"
        + (f" ({status.task})" if status.task else "")
        for index, (client, status) in enumerate(zip(tier.clients, statuses, strict=True))
        if not status.serving
    ]
    return "; ".join(waiting) or None


_CANNOT_SERVE = "a shard answers but cannot serve (lookups that need it fail until it does): %s"


def _watch_shards(
    tier: RemoteShardTier,
    readiness: _Readiness,
    stop: threading.Event,
    timeout: float,
    waiting: str | None = None,
) -> None:
    """Until ``stop``: every :data:`SHARD_CHECK_INTERVAL_SECONDS`, ask every shard's status
    (one deadline of ``timeout`` s for all) and set :data:`SHARDS_SERVICE` by the answer: a
    shard killed or unreachable, or one that answers but cannot serve yet (loading its
    checkpoint, not configured), turns it NOT_SERVING; every shard serving, SERVING again.
    Logged when a shard goes away, each time the reason changes while it is away (refused,
    then "cannot serve yet" while it loads) and when every shard serves again. ``waiting``:
    the shards the start-up check found not serving (:func:`_cannot_serve_yet`), logged then."""
    down = DownReasons()
    if waiting is not None:
        down.down(waiting)
    while not stop.wait(SHARD_CHECK_INTERVAL_SECONDS):
        try:
            waiting = _cannot_serve_yet(tier, tier.verify_shards(timeout=timeout))
        except RecserveError as error:
            readiness.set_shards_serving(False)
            if down.down(error.message) and not stop.is_set():
                log.warning(
                    "a shard is away (lookups that need it fail until it is back): %s",
                    error.message,
                )
        except Exception:  # the watcher must outlive any surprise; report it
            readiness.set_shards_serving(False)
            if down.down("checking the shards failed") and not stop.is_set():
                log.exception("checking the shards failed")
        else:
            readiness.set_shards_serving(waiting is None)
            if waiting is not None:
                if down.down(waiting) and not stop.is_set():
                    log.warning(_CANNOT_SERVE, waiting)
            elif down.up() and not stop.is_set():
                log.info("embedding worker reaches every shard, and each serves, again")


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
    waiting: str | None = None  # the shards that answered but cannot serve yet
    while not requested.requested:
        try:
            waiting = _cannot_serve_yet(tier, tier.verify_shards())
            break
        except (UnavailableError, DeadlineExceededError) as error:
            if time.monotonic() > deadline:
                log.error("shards not reachable within %.0f s: %s", startup_timeout, error)
                server.stop(0)
                tier.close()
                return 1
            # A shard address that is an HTTP port fails now: waiting would not change it.
            if not answered_in_http1(error.message):
                requested.wait(0.2)
                continue
            log.error("%s", error.message)
            print(f"embedding worker: error: {error.message}", file=sys.stderr, flush=True)
            server.stop(0)
            tier.close()
            return 1
        except RecserveError as error:
            log.error("%s", error.message)
            print(f"embedding worker: error: {error.message}", file=sys.stderr, flush=True)
            server.stop(0)
            tier.close()
            return 1
    readiness = _Readiness(health_servicer)
    watcher = None
    if not requested.requested:  # a SIGTERM during the wait: to the drain, never SERVING
        readiness.start(shards_serving=waiting is None)
        log.info("embedding worker serving %d shard(s): %s", len(shard_addresses), shard_addresses)
        if waiting is not None:  # unconfigured training shards, loading inference ones
            log.info(_CANNOT_SERVE, waiting)
        watcher = threading.Thread(
            target=_watch_shards,
            args=(tier, readiness, stop, check_timeout, waiting),
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
    "EmbeddingWorkerServicer",
    "serve_embedding_worker",
]
