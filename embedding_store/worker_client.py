"""Client of the ``embedding-worker`` service: the gRPC implementation of EmbeddingTier."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store import checkpoint_manifest
from embedding_store.batch import Batch
from embedding_store.config import EmbeddingConfig, embedding_config_from_mapping
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import (
    WORKER_SERVICE,
    answered_in_http1,
    call,
    call_with_retries,
    channel_options,
    error_from_rpc,
    http1_message,
    tier_channel,
)
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import settings_to_configure_request
from embedding_store.optimizers import Optimizer
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.renewing_channel import HEALTH_CHECK_METHOD
from embedding_store.tier_types import (
    BackwardStats,
    IdFeature,
    LookupResult,
    ProgressCallback,
    SlotOutput,
    TierStatus,
)
from embedding_store.worker_wire import decode_unknown_per_sample, pack_grads, unpack_slots

if TYPE_CHECKING:  # torch costs ~1 s of CPU: `recserve embedding-tier` needs none
    import torch

_SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingWorker"].full_name
#: Calls that may reach the worker twice (renewing_channel.RenewingTierChannel retries them once
#: after a TLS renewal): reads. A train lookup sent twice leaves one forward context unused,
#: which expires as any other; never a backward, whose gradients would be applied twice.
RETRY_SAFE_METHODS = frozenset({f"/{_SERVICE}/Lookup", f"/{_SERVICE}/Status", HEALTH_CHECK_METHOD})


class RemoteEmbeddingWorker:
    """An embedding worker reached over gRPC; same interface as InProcessEmbeddingTier.

    Every call has a deadline (``timeout`` seconds; dumps and loads ``admin_timeout``), and
    failures raise recserve errors naming the worker's address. With ``retry_seconds`` > 0
    (training sets it) the training path (lookup, backward, flush, configure, status) rides
    out an unreachable worker, or a worker whose shard is unreachable, for up to that long:
    a restarted shard or a network blip must not end a run that would go on once it is back
    (a lookup is sent again on any UNAVAILABLE; a backward or flush only when it never left
    this process, since one that reached the worker may have been applied, and a flush's
    UNAVAILABLE reports lost pushes).
    """

    def __init__(
        self,
        address: str,
        embedding_config: EmbeddingConfig | None,
        *,
        timeout: float = 30.0,
        admin_timeout: float = 600.0,
        retry_seconds: float = 0.0,
    ) -> None:
        self.address = address
        self.retry_seconds = retry_seconds
        self.embedding_config = embedding_config
        self.timeout = timeout
        self.admin_timeout = admin_timeout
        self._peer = f"embedding worker {address}"
        self._config_cache: tuple[str, EmbeddingConfig] | None = None
        self._channel = tier_channel(address, channel_options(), retry_safe=RETRY_SAFE_METHODS)
        self._stub = pb_grpc.EmbeddingWorkerStub(self._channel)
        # Refs of train lookups abandoned without a backward, sent with the next lookup.
        self._abandoned_refs: list[int] = []
        self._abandoned_lock = threading.Lock()
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def wait_for_serving(self, timeout: float = 60.0) -> None:
        """Block until the worker reports SERVING (its shards answer); else UnavailableError."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                answer = self._health.Check(
                    health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=2.0
                )
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    # A worker marks its services NOT_SERVING before its port opens, so a
                    # health service that does not know them belongs to another process:
                    # waiting out the timeout would not change the answer.
                    raise UnavailableError(
                        f"{self._peer} is not an embedding worker: its health service does "
                        f"not know {WORKER_SERVICE} (is it a parameter-server shard's or a "
                        "prediction server's port? Embedding workers, shards and prediction "
                        "servers each listen on ports of their own)"
                    ) from None
                details = error.details() or str(error.code())
                if answered_in_http1(details):  # an HTTP port: waiting would not change it
                    raise UnavailableError(f"{http1_message(self._peer)} ({details})") from None
                last = details
            time.sleep(0.1)
        raise UnavailableError(f"{self._peer} is not serving after {timeout:g} s ({last})")

    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        if not isinstance(batch, Batch):
            batch = Batch(list(batch), requires_grad=False)
        elif batch.requires_grad or batch.non_id_type_features or batch.labels:
            # Only ID features travel to the embedding tier.
            batch = Batch(list(batch.id_type_features), requires_grad=False)
        with self._abandoned_lock:
            drop, self._abandoned_refs = self._abandoned_refs, []
        request = pb.WorkerLookupRequest(batch=batch.to_bytes(), train=train, drop_refs=drop)
        try:
            response = self._retried(self._stub.Lookup, request, self.timeout, resend=True)
        except BaseException:
            if drop:  # for the next lookup (dropping a context twice is harmless)
                with self._abandoned_lock:
                    self._abandoned_refs[:0] = drop
            raise
        try:
            slots = unpack_slots(response.slots)
            self._check_answer(batch.id_type_features, slots)
            per_sample = decode_unknown_per_sample(
                response.unknown_per_sample, batch.batch_size, response.unknown_ids
            )
        except InvalidArgumentError as error:
            raise RecserveError(f"{self._peer} sent a malformed answer: {error.message}") from None
        return LookupResult(
            slots=slots,
            ref=response.ref if train else None,
            unknown_ids=response.unknown_ids,
            unknown_per_sample=per_sample,
        )

    def _check_answer(self, features: Sequence[IdFeature], slots: Sequence[SlotOutput]) -> None:
        """InvalidArgumentError unless ``slots`` are the batch's ``features`` in order, each
        of the shape an embedding worker answers for it (the embedding config's dim and
        ``sample_fixed_size`` when this client has the config): whatever the peer sends goes
        to the dense model as is, and rows of another batch size could come back as
        predictions of another shape, or as a bare error of the model."""
        if [slot.name for slot in slots] != [feature.name for feature in features]:
            raise InvalidArgumentError(
                f"slots {[slot.name for slot in slots][:8]} for features "
                f"{[feature.name for feature in features][:8]}"
            )
        config = self.embedding_config
        for feature, slot in zip(features, slots, strict=True):
            shape = tuple(slot.embeddings.shape)
            slot_config = None if config is None else config.slots_config.get(feature.name)
            if slot_config is None:
                expected_ndim = len(shape) if len(shape) in (2, 3) else 2
                ok = len(shape) == expected_ndim and shape[0] == feature.batch_size
                wanted = f"[{feature.batch_size}, ...]"
            else:
                wanted_shape: tuple[int, ...] = (feature.batch_size, slot_config.dim)
                if not slot_config.embedding_summation:
                    wanted_shape = (
                        feature.batch_size,
                        slot_config.sample_fixed_size,
                        slot_config.dim,
                    )
                ok = shape == wanted_shape
                wanted = str(list(wanted_shape))
            if not ok:
                raise InvalidArgumentError(
                    f"slot {feature.name!r} has shape {list(shape)}, expected {wanted} for a "
                    f"batch of {feature.batch_size}"
                )

    def drop_forward_contexts(self, refs: Sequence[int]) -> None:
        """Have the worker drop the contexts of train lookups ``refs`` abandoned without a
        backward: sent with the next lookup (``WorkerLookupRequest.drop_refs``), not in a
        call of their own. A worker that predates the field ignores them (they expire)."""
        with self._abandoned_lock:
            self._abandoned_refs.extend(int(ref) for ref in refs)

    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        """:meth:`EmbeddingTier.backward` over gRPC: the worker checks the gradients and
        queues them (``rows_pushed`` counts rows queued); :meth:`flush` waits until applied."""
        request = pb.BackwardRequest(ref=ref)
        pack_grads(request.grads, grads)
        response = self._retried(self._stub.Backward, request, self.timeout, resend=False)
        return BackwardStats(
            rows_pushed=response.rows_queued,
            nonfinite_rows_skipped=response.nonfinite_rows_skipped,
        )

    def _retried(
        self, method: Callable[..., Any], request: Any, timeout: float, *, resend: bool
    ) -> Any:
        return call_with_retries(
            self._peer,
            method,
            request,
            timeout=timeout,
            retry_seconds=self.retry_seconds,
            resend=resend,
        )

    def flush(self) -> None:
        self._retried(self._stub.Flush, pb.FlushRequest(), self.admin_timeout, resend=False)

    def configure(
        self,
        *,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        request = settings_to_configure_request(optimizer, initialization)
        self._retried(self._stub.Configure, request, self.timeout, resend=True)

    def _admin_error(self, error: grpc.RpcError, what: str) -> RecserveError:
        """The error of a failed admin call; past its deadline, what the caller can do: the
        worker abandons the task if it had not changed anything yet, else it may complete."""
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceededError(
                f"{self._peer} did not finish the {what} within the deadline "
                f"({self.admin_timeout:g} s); it may still complete on the worker: check "
                f"`recserve embedding-tier status --worker {self.address}` (the worker reads "
                "idle once it ended) before trying again"
            )
        return error_from_rpc(error, self._peer)

    def _stream(
        self,
        method: Callable[..., Iterator[pb.Progress]],
        request: pb.WorkerDumpRequest | pb.WorkerLoadRequest,
        progress: ProgressCallback | None,
        what: str,
    ) -> None:
        try:
            for update in method(request, timeout=self.admin_timeout):
                if progress and update.stage != "done":
                    progress(update.stage, update.done, update.total)
        except grpc.RpcError as error:
            raise self._admin_error(error, what) from None

    def dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        progress: ProgressCallback | None = None,
    ) -> checkpoint_manifest.EmbeddingManifest:
        path = os.path.abspath(directory)
        request = pb.WorkerDumpRequest(directory=path, overwrite=overwrite)
        self._stream(self._stub.Dump, request, progress, f"dump to {path}")
        return checkpoint_manifest.read_manifest(path)

    def load(
        self, directory: str | os.PathLike, *, progress: ProgressCallback | None = None
    ) -> checkpoint_manifest.EmbeddingManifest:
        path = os.path.abspath(directory)
        request = pb.WorkerLoadRequest(directory=path)
        self._stream(self._stub.Load, request, progress, f"load of {path}")
        return checkpoint_manifest.read_manifest(path)

    def clear(self) -> None:
        call(self._peer, self._stub.Clear, pb.ClearRequest(), timeout=self.admin_timeout)

    def status(self, *, partial: bool = False) -> TierStatus:
        """The tier's status, asked of the worker. A shard that did not answer the worker
        raises UnavailableError naming it; with ``partial``, it is in ``shard_errors``."""
        response = self._retried(
            self._stub.Status, pb.WorkerStatusRequest(), self.timeout, resend=True
        )
        failed = [
            f"shard {index}: {error}" for index, error in enumerate(response.shard_errors) if error
        ]
        if failed and not partial:
            raise UnavailableError(
                f"{self._peer}: {len(failed)} shard(s) did not answer: " + "; ".join(failed)
            )
        return TierStatus(
            rows_per_shard=tuple(s.rows for s in response.shard_status),
            capacity_per_shard=tuple(s.capacity for s in response.shard_status),
            pending_backward=response.pending_backward,
            pending_gradient_batches=response.pending_gradient_batches,
            nonfinite_rows_skipped=response.nonfinite_rows_skipped,
            shard_tasks=tuple(s.task for s in response.shard_status),
            shard_task_progress=tuple(s.task_progress for s in response.shard_status),
            task=response.task,
            task_progress=response.task_progress,
            shard_serving=tuple(s.serving for s in response.shard_status),
            shard_checkpoint_versions=tuple(s.checkpoint_version for s in response.shard_status),
            shard_errors=tuple(response.shard_errors) if partial else (),
            embedding_config=self._reported_config(response.embedding_config_json),
            forward_buffer_size=response.forward_buffer_size,
            shard_addresses=tuple(response.shards),
        )

    def _reported_config(self, text: str) -> EmbeddingConfig | None:
        """The embedding config a Status reported (None: the worker predates the field);
        parsed once per distinct text, as servers ask every 2 s."""
        if not text:
            return None
        cached = self._config_cache
        if cached is not None and cached[0] == text:
            return cached[1]
        try:
            config = embedding_config_from_mapping(
                json.loads(text), source=f"the embedding config {self._peer} reported"
            )
        except (ValueError, RecserveError) as error:
            reason = getattr(error, "message", str(error))
            raise RecserveError(f"{self._peer} sent a malformed answer: {reason}") from None
        self._config_cache = (text, config)
        return config

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RemoteEmbeddingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
