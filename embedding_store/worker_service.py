"""The ``embedding-worker`` service: the worker core over remote parameter-server shards.

:class:`RemoteShardTier` is the core object: an :class:`EmbeddingWorker` whose shards are
``RemoteParameterServer`` clients, an asynchronous gradient pusher with a bounded queue, and
checkpoint orchestration across shards. :class:`EmbeddingWorkerServicer` only decodes gRPC
requests, calls it, and encodes answers. :func:`serve_embedding_worker` runs the process.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedding_store import checkpoint
from embedding_store.batch import Batch
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import InvalidArgumentError, RecserveError, UnavailableError
from embedding_store.grpc_common import rpc_errors, rpc_stream_errors, server_options
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import configure_request_to_settings
from embedding_store.optimizers import Optimizer
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.tier import ProgressCallback, TierStatus
from embedding_store.worker import BackwardStats, EmbeddingWorker, LookupResult
from embedding_store.worker_wire import pack_slots, unpack_grads

log = logging.getLogger(__name__)

SERVICE_NAME = "recserve.embedding.v1.EmbeddingWorker"


class RemoteShardTier:
    """Worker core + remote shards + asynchronous gradient pushes (bounded staleness).

    ``backward`` enqueues the gradients of a forward pass and returns at once; one pusher
    thread scatters them and sends them to the shards in order. At most
    ``forward_buffer_size`` gradient batches wait; a further ``backward`` blocks until one
    leaves (backpressure instead of unbounded memory). :meth:`flush` waits for the queue.
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        shard_addresses: Sequence[str],
        *,
        forward_buffer_size: int = 1000,
        shard_timeout: float = 10.0,
    ) -> None:
        if not shard_addresses:
            raise InvalidArgumentError("an embedding worker needs at least one --ps address")
        self.embedding_config = embedding_config
        self.shard_addresses = tuple(shard_addresses)
        self.clients = [
            RemoteParameterServer(address, replica_index=i, timeout=shard_timeout)
            for i, address in enumerate(shard_addresses)
        ]
        self._executor = ThreadPoolExecutor(
            max_workers=max(2, len(self.clients)), thread_name_prefix="shard-call"
        )
        self.worker = EmbeddingWorker(
            embedding_config,
            self.clients,
            forward_buffer_size=forward_buffer_size,
            executor=self._executor,
            deduplicate=True,
        )
        self._gradients: queue.Queue = queue.Queue(maxsize=forward_buffer_size)
        self._failed_pushes = 0
        self._last_push_error: str | None = None
        self._pusher = threading.Thread(target=self._push_loop, name="gradient-pusher", daemon=True)
        self._pusher.start()

    # ------------------------------------------------------------------ readiness
    def verify_shards(self) -> None:
        """Check that shard i answers as replica i of N; raises naming the first mismatch."""
        size = len(self.clients)
        for index, client in enumerate(self.clients):
            status = client.status()
            if status.replica_index != index or status.replica_size != size:
                raise InvalidArgumentError(
                    f"parameter server {client.address} answers as replica "
                    f"{status.replica_index} of {status.replica_size}, but was given as "
                    f"replica {index} of {size} (check the order of --ps addresses)"
                )

    # ------------------------------------------------------------------ lookups
    def lookup(self, batch: Batch, *, train: bool) -> LookupResult:
        return self.worker.lookup(batch, train=train)

    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        self._gradients.put((ref, grads))
        return BackwardStats(rows_pushed=0, nonfinite_rows_skipped=0)

    def _push_loop(self) -> None:
        while True:
            item = self._gradients.get()
            try:
                if item is None:
                    return
                ref, grads = item
                self.worker.backward(ref, grads)
            except Exception as error:  # keep pushing later batches; report on flush
                self._failed_pushes += 1
                self._last_push_error = getattr(error, "message", repr(error))
                log.warning("gradient push failed: %s", self._last_push_error)
            finally:
                self._gradients.task_done()

    def flush(self) -> None:
        """Wait until every queued gradient batch was applied; report failed pushes."""
        self._gradients.join()
        if self._failed_pushes:
            failed, last = self._failed_pushes, self._last_push_error
            self._failed_pushes, self._last_push_error = 0, None
            raise UnavailableError(
                f"{failed} gradient batch(es) could not be applied since the last flush; "
                f"last error: {last}"
            )

    @property
    def pending_gradient_batches(self) -> int:
        return self._gradients.qsize()

    # ------------------------------------------------------------------ administration
    def _each(self, task) -> list:
        futures = [self._executor.submit(task, client) for client in self.clients]
        return [future.result() for future in futures]

    def configure(
        self,
        *,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        self._each(lambda c: c.configure(optimizer=optimizer, initialization=initialization))

    def clear(self) -> None:
        self.flush()
        self._each(lambda c: c.clear())

    def dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        progress: ProgressCallback | None = None,
    ) -> checkpoint.EmbeddingManifest:
        """Every shard writes its part into a staging directory; the worker then writes the
        manifest and the done-marker and renames the directory into place."""
        self.flush()
        target = Path(directory).absolute()
        if target.exists() and not overwrite:
            raise checkpoint.AlreadyExistsError(
                f"checkpoint directory {target} already exists; refusing to overwrite it"
            )
        staging = checkpoint.staging_directory_for(target)
        total = len(self.clients)
        done = 0
        lock = threading.Lock()
        try:
            if progress:
                progress("dump", 0, total)

            def dump_one(client: RemoteParameterServer):
                nonlocal done
                result = client.dump(str(staging))
                with lock:
                    done += 1
                    if progress:
                        progress("dump", done, total)
                return result

            results = self._each(dump_one)
            entries = [entry for files, _ in results for entry in files]
            optimizer = results[0][1]
            checkpoint.finalize_checkpoint(
                staging, self.embedding_config, total, entries, optimizer
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        checkpoint.publish_directory(staging, target, overwrite=overwrite)
        return checkpoint.read_manifest(target)

    def load(
        self, directory: str | os.PathLike, *, progress: ProgressCallback | None = None
    ) -> checkpoint.EmbeddingManifest:
        """Same shard count: each shard loads its own files. Another count: the worker reads
        the rows, re-shards them and streams each shard its part."""
        self.flush()
        target = Path(directory).absolute()
        manifest = checkpoint.read_manifest(target)
        checkpoint.check_compatible(manifest, self.embedding_config)
        total = len(self.clients)
        if progress:
            progress("load", 0, total)
        if manifest.num_shards == total:
            self._each(lambda c: c.load(str(target)))
            if progress:
                progress("load", total, total)
            return manifest
        statuses = self._each(lambda c: c.status())
        if any(status.read_only for status in statuses):
            # Read-only (infer) shards accept only whole replacements: each one reads the
            # checkpoint and keeps the rows it owns under the new count, atomically.
            self._each(lambda c: c.load(str(target)))
            if progress:
                progress("load", total, total)
            return manifest
        staged = []
        for index, status in enumerate(statuses):
            keep = _optimizer_name(status.optimizer_json)
            blocks = checkpoint.read_rows_for_replica(manifest, index, total, keep_state_of=keep)
            rows = sum(len(b.ids) for b in blocks)
            if rows > status.capacity:
                raise checkpoint.CheckpointError(
                    f"embedding checkpoint {target} gives shard {index} {rows} rows, more than "
                    f"its capacity {status.capacity}"
                )
            staged.append(blocks)
        for index, (client, blocks) in enumerate(zip(self.clients, staged)):
            client.clear()
            client.import_rows(blocks)
            if progress:
                progress("load", index + 1, total)
        return manifest

    def status(self) -> TierStatus:
        statuses = self._each(lambda c: c.status())
        return TierStatus(
            rows_per_shard=tuple(s.rows for s in statuses),
            capacity_per_shard=tuple(s.capacity for s in statuses),
            pending_backward=self.worker.pending_backward,
            pending_gradient_batches=self.pending_gradient_batches,
            nonfinite_rows_skipped=self.worker.nonfinite_rows_skipped,
        )

    def shard_statuses(self) -> list:
        return self._each(lambda c: c.status())

    def close(self) -> None:
        self._gradients.put(None)
        self._pusher.join(timeout=10)
        for client in self.clients:
            client.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _optimizer_name(optimizer_json: str) -> str | None:
    if not optimizer_json:
        return None
    import json

    return json.loads(optimizer_json).get("name")


class EmbeddingWorkerServicer(pb_grpc.EmbeddingWorkerServicer):
    """gRPC front end of :class:`RemoteShardTier`: decode, call, encode."""

    def __init__(self, tier: RemoteShardTier) -> None:
        self.tier = tier

    @rpc_errors
    def Lookup(self, request: pb.WorkerLookupRequest, context) -> pb.WorkerLookupResponse:
        batch = Batch.from_bytes(request.batch)
        result = self.tier.lookup(batch, train=request.train)
        response = pb.WorkerLookupResponse(ref=result.ref or 0, unknown_ids=result.unknown_ids)
        pack_slots(response.slots, result.slots)
        return response

    @rpc_errors
    def Backward(self, request: pb.BackwardRequest, context) -> pb.BackwardResponse:
        stats = self.tier.backward(request.ref, unpack_grads(request.grads))
        return pb.BackwardResponse(
            rows_queued=stats.rows_pushed, nonfinite_rows_skipped=stats.nonfinite_rows_skipped
        )

    @rpc_errors
    def Flush(self, request: pb.FlushRequest, context) -> pb.FlushResponse:
        self.tier.flush()
        return pb.FlushResponse()

    @rpc_errors
    def Configure(self, request: pb.ConfigureRequest, context) -> pb.ConfigureResponse:
        optimizer, initialization = configure_request_to_settings(request)
        self.tier.configure(optimizer=optimizer, initialization=initialization)
        return pb.ConfigureResponse()

    @rpc_stream_errors
    def Dump(self, request: pb.WorkerDumpRequest, context) -> Iterator[pb.Progress]:
        if not request.directory:
            raise InvalidArgumentError("WorkerDumpRequest.directory must not be empty")
        yield from _with_progress(
            lambda progress: self.tier.dump(
                request.directory, overwrite=request.overwrite, progress=progress
            ),
            f"dumped to {request.directory}",
        )

    @rpc_stream_errors
    def Load(self, request: pb.WorkerLoadRequest, context) -> Iterator[pb.Progress]:
        if not request.directory:
            raise InvalidArgumentError("WorkerLoadRequest.directory must not be empty")
        yield from _with_progress(
            lambda progress: self.tier.load(request.directory, progress=progress),
            f"loaded {request.directory}",
        )

    @rpc_errors
    def Clear(self, request: pb.ClearRequest, context) -> pb.ClearResponse:
        self.tier.clear()
        return pb.ClearResponse()

    @rpc_errors
    def Status(self, request: pb.WorkerStatusRequest, context) -> pb.WorkerStatusResponse:
        status = self.tier.status()
        size = len(status.rows_per_shard)
        return pb.WorkerStatusResponse(
            shards=list(self.tier.shard_addresses),
            shard_status=[
                pb.ShardStatusResponse(
                    replica_index=i, replica_size=size, rows=rows, capacity=capacity
                )
                for i, (rows, capacity) in enumerate(
                    zip(status.rows_per_shard, status.capacity_per_shard)
                )
            ],
            pending_backward=status.pending_backward,
            pending_gradient_batches=status.pending_gradient_batches,
            nonfinite_rows_skipped=status.nonfinite_rows_skipped,
        )


def _with_progress(run, final_message: str) -> Iterator[pb.Progress]:
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
    forward_buffer_size: int = 1000,
    shard_timeout: float = 10.0,
    startup_timeout: float = 60.0,
    grace_seconds: float = 5.0,
) -> int:
    """Run the worker service until SIGTERM/SIGINT; returns the exit code (0 when drained)."""
    tier = RemoteShardTier(
        embedding_config,
        shard_addresses,
        forward_buffer_size=forward_buffer_size,
        shard_timeout=shard_timeout,
    )
    server = grpc.server(
        ThreadPoolExecutor(max_workers=8, thread_name_prefix="worker-rpc"),
        options=server_options(),
    )
    pb_grpc.add_EmbeddingWorkerServicer_to_server(EmbeddingWorkerServicer(tier), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["EmbeddingWorker"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise UnavailableError(f"cannot listen on {host}:{port}")
    server.start()
    print(f"embedding worker listening on {host}:{bound}", flush=True)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    deadline = time.monotonic() + startup_timeout
    while not stop.is_set():
        try:
            tier.verify_shards()
            break
        except UnavailableError as error:
            if time.monotonic() > deadline:
                log.error("shards not reachable within %.0f s: %s", startup_timeout, error)
                server.stop(0)
                tier.close()
                return 1
            stop.wait(0.2)
        except RecserveError as error:
            log.error("%s", error.message)
            print(f"embedding worker: error: {error.message}", file=sys.stderr, flush=True)
            server.stop(0)
            tier.close()
            return 1
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("embedding worker serving %d shard(s): %s", len(shard_addresses), shard_addresses)

    stop.wait()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace_seconds).wait()
    try:
        tier.flush()
    except RecserveError as error:
        log.warning("on shutdown: %s", error.message)
    tier.close()
    return 0


__all__ = [
    "SERVICE_NAME",
    "EmbeddingWorkerServicer",
    "RemoteShardTier",
    "serve_embedding_worker",
]
