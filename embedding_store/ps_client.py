"""gRPC client of one remote parameter-server shard.

:class:`RemoteParameterServer` implements :class:`embedding_store.interfaces.ParameterServer`
(``lookup``/``update``) like an in-process :class:`~embedding_store.shard.EmbeddingShard`, plus
the control calls (configure, dump, load, row export/import, clear, status, health). It keeps
one long-lived channel; every call has a deadline, and every failure is raised as the
:mod:`embedding_store.errors` class of its status code with a message naming the peer, e.g.
``"parameter server 127.0.0.1:7001 (shard 1) is unavailable: ..."``.
"""

from __future__ import annotations

import contextvars
import functools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store.checkpoint_manifest import FileEntry
from embedding_store.config import EmbeddingConfig, embedding_config_from_mapping
from embedding_store.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import (
    call,
    call_with_retries,
    channel_options,
    error_from_rpc,
    pack_f32,
    pack_u64,
    tier_channel,
    unpack_f32,
)
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import settings_to_configure_request
from embedding_store.optimizers import SGD, Adagrad, Adam
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_service import NOT_LOADED_YET, SERVICE_NAME
from embedding_store.ps_wire import decode_missing, row_block_from_chunk, row_chunks
from embedding_store.renewing_channel import HEALTH_CHECK_METHOD
from embedding_store.shard import RowBlock

#: Default deadline of dump, load, export and import calls (seconds).
DEFAULT_CHECKPOINT_TIMEOUT = 600.0
#: How often a load asks whether its caller is still there (``load(caller_gone=...)``).
_CALLER_CHECK_SECONDS = 0.1

#: The deadline (a ``time.monotonic()`` value) of the call this context serves, when it has
#: one: shard lookups made for it get at most the time left (an embedding worker sets it
#: from its caller's deadline, a little earlier). A shard that hangs then fails the lookup
#: as DEADLINE_EXCEEDED naming the shard, in time for the caller to be told; a longer shard
#: deadline than the caller's would leave it only "the worker did not answer".
caller_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "recserve_caller_deadline", default=None
)
#: The least deadline a shard lookup (or status call) gets when its caller's is (nearly) past.
MIN_LOOKUP_SECONDS = 0.01

_SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
#: Calls that may reach the shard twice (renewing_channel.RenewingTierChannel retries them once
#: after a TLS renewal): reads. A train lookup inserts the rows it misses, as it would
#: have the first time; never an update, whose gradient would be applied twice.
RETRY_SAFE_METHODS = frozenset({f"/{_SERVICE}/Lookup", f"/{_SERVICE}/Status", HEALTH_CHECK_METHOD})


@functools.lru_cache(maxsize=16)
def _reported_config(text: str) -> EmbeddingConfig:
    """The embedding config a shard's Status reported (parsed once per text: workers and
    servers ask every 2 s)."""
    try:
        mapping = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"the reported embedding config is not JSON: {error}") from None
    return embedding_config_from_mapping(mapping, source="the reported embedding config")


@dataclass(frozen=True)
class ShardStatus:
    """What a parameter server reports about its shard (mirrors ShardStatusResponse)."""

    replica_index: int
    replica_size: int
    rows: int
    capacity: int
    read_only: bool
    job_type: str
    optimizer_json: str  # the optimizer's settings as JSON; "" when none is configured
    serving: bool
    lookups: int
    ids_looked_up: int
    misses: int
    evictions: int
    task: str  # "", "loading" or "dumping"
    task_progress: float
    #: The embedding checkpoint version the rows were loaded from; "" when none was loaded
    #: or the rows changed since (EmbeddingShard.checkpoint_version).
    checkpoint_version: str = ""
    #: The shard's embedding config; None when it does not say (an older shard).
    embedding_config: EmbeddingConfig | None = None

    @classmethod
    def from_proto(cls, message: pb.ShardStatusResponse) -> ShardStatus:
        """The status ``message`` reports; ConfigError when its embedding config is not one."""
        text = message.embedding_config_json
        return cls(
            embedding_config=_reported_config(text) if text else None,
            replica_index=message.replica_index,
            replica_size=message.replica_size,
            rows=message.rows,
            capacity=message.capacity,
            read_only=message.read_only,
            job_type=message.job_type,
            optimizer_json=message.optimizer_json,
            serving=message.serving,
            lookups=message.lookups,
            ids_looked_up=message.ids_looked_up,
            misses=message.misses,
            evictions=message.evictions,
            task=message.task,
            task_progress=message.task_progress,
            checkpoint_version=message.checkpoint_version,
        )

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The optimizer's settings (``optimizer_from_dict`` reads them), or None."""
        return json.loads(self.optimizer_json) if self.optimizer_json else None


class _RowChunkStream(Protocol):
    """A server-streaming gRPC call: an iterator of chunks that can also be cancelled."""

    def __iter__(self) -> Iterator[pb.RowChunk]: ...

    def cancel(self) -> bool: ...


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def _check_ids(ids: object) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise InvalidArgumentError(f"ids must be a uint64 [n] array, got {_describe(ids)}")
    return ids


def _check_dim(dim: object) -> int:
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidArgumentError(f"dim must be a positive integer, got {dim!r}")
    if dim >= 2**32:
        raise InvalidArgumentError(f"dim must be < 2**32, got {dim!r}")
    return int(dim)


def _still_loading(error: grpc.RpcError) -> bool:
    """Whether ``error`` is a shard's answer that it has yet to load its checkpoint (a
    restarted ``--load-checkpoint`` shard): the update was refused before it was applied."""
    details = (error.details() if hasattr(error, "details") else None) or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and NOT_LOADED_YET in details


class RemoteParameterServer:
    """One remote parameter-server shard at ``address`` (``host:port``).

    ``replica_index`` names the shard in error messages; with ``replica_size`` too, lookups
    and updates say which replica of how many they are for, and a shard that is another
    refuses them (UNAVAILABLE) instead of answering from another part of the table.
    ``timeout`` is the deadline of the data-path and control calls; ``checkpoint_timeout``
    that of dump, load, export and import (each also takes its own ``timeout=``).
    ``update_retry_seconds``: how long a gradient update is sent again while the shard cannot
    be reached (the embedding worker's pushes ride out a shard restart; an update that
    reached the shard is never resent).
    Thread-safe: gRPC channels are.
    """

    def __init__(
        self,
        address: str,
        *,
        replica_index: int | None = None,
        replica_size: int | None = None,
        timeout: float = 10.0,
        checkpoint_timeout: float = DEFAULT_CHECKPOINT_TIMEOUT,
        update_retry_seconds: float = 0.0,
    ) -> None:
        if not isinstance(address, str) or not address:
            raise InvalidArgumentError(f"address must be a non-empty 'host:port', got {address!r}")
        if not timeout > 0 or not checkpoint_timeout > 0:
            raise InvalidArgumentError(
                f"timeouts must be > 0, got timeout={timeout!r}, "
                f"checkpoint_timeout={checkpoint_timeout!r}"
            )
        self.address = address
        self.replica_index = replica_index
        self.replica_size = replica_size
        # Sent with every lookup and update when both are known (replica_size 0: not said).
        self._replica = (
            {"replica_index": replica_index, "replica_size": replica_size}
            if replica_index is not None and replica_size is not None
            else {}
        )
        self.timeout = float(timeout)
        self.checkpoint_timeout = float(checkpoint_timeout)
        self.update_retry_seconds = float(update_retry_seconds)
        self.peer = f"parameter server {address}" + (
            f" (shard {replica_index})" if replica_index is not None else ""
        )
        self._channel = tier_channel(address, channel_options(), retry_safe=RETRY_SAFE_METHODS)
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._local = threading.local()
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteParameterServer({self.address!r}, replica_index={self.replica_index!r})"

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> RemoteParameterServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(
        self, method: Callable[..., Any], request: Message, timeout: float | None = None
    ) -> Any:
        return call(
            self.peer, method, request, timeout=self.timeout if timeout is None else timeout
        )

    @staticmethod
    def _within_caller_deadline(timeout: float) -> float:
        """``timeout``, cut to the time left before :data:`caller_deadline` when one is set
        (:data:`MIN_LOOKUP_SECONDS` at least)."""
        deadline = caller_deadline.get()
        if deadline is None:
            return timeout
        return min(timeout, max(deadline - time.monotonic(), MIN_LOOKUP_SECONDS))

    # ------------------------------------------------------------------ data path
    @property
    def last_misses(self) -> int:
        """IDs answered with zeros by this thread's last lookup (unknown IDs of an eval lookup,
        or IDs refused admission by a train lookup), per position of its ``ids``."""
        return getattr(self._local, "misses", 0)

    @property
    def last_missing(self) -> np.ndarray | None:
        """Which IDs this thread's last lookup answered with zeros: bool [n] over the
        positions of its ``ids``; None when none was, or when the shard predates
        ``LookupResponse.missing`` and only said how many (:attr:`last_misses` > 0)."""
        return getattr(self._local, "missing", None)

    @property
    def last_generation(self) -> int | None:
        """The shard's row generation that this thread's last train lookup was answered at
        (``LookupResponse.generation``), for :meth:`update`; None when the shard did not say
        (an eval lookup, a shard that predates the field)."""
        return getattr(self._local, "generation", None)

    def lookup_with_misses(
        self, ids: np.ndarray, dim: int, *, train: bool
    ) -> tuple[np.ndarray, int]:
        """Rows of ``ids`` (uint64 [n]) -> (float32 [n, dim], IDs answered with zeros)."""
        ids = _check_ids(ids)
        dim = _check_dim(dim)
        response = self._call(
            self._stub.Lookup,
            pb.LookupRequest(ids=pack_u64(ids), dim=dim, train=bool(train), **self._replica),
            self._within_caller_deadline(self.timeout),
        )
        try:
            rows = unpack_f32(response.rows, (ids.shape[0], dim), "LookupResponse.rows")
            missing = decode_missing(
                response.missing, ids.shape[0], response.misses, "LookupResponse.missing"
            )
        except InvalidArgumentError as error:
            raise RecserveError(f"{self.peer} sent a malformed answer: {error.message}") from None
        rows = rows.copy()  # writable, like an in-process shard's answer
        self._local.misses = int(response.misses)
        self._local.missing = missing
        # 0: an eval lookup, or a shard that predates LookupResponse.generation.
        self._local.generation = int(response.generation) or None
        return rows, int(response.misses)

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        """Rows of ``ids`` (uint64 [n]) -> float32 [n, dim] (see :meth:`last_misses`)."""
        return self.lookup_with_misses(ids, dim, train=train)[0]

    def update(self, ids: np.ndarray, grads: np.ndarray, *, generation: int | None = None) -> int:
        """Apply the shard's optimizer to ``ids`` (uint64 [n], unique) with ``grads`` float32
        [n, dim]; returns the rows updated. ``generation``: the :attr:`last_generation` of
        the lookup the gradients were computed after: the shard refuses them
        (FailedPreconditionError) when a load or clear replaced the rows since."""
        ids = _check_ids(ids)
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2:
            raise InvalidArgumentError(
                f"grads must be a float32 [n, dim] array, got {_describe(grads)}"
            )
        if grads.shape[0] != ids.shape[0] or grads.shape[1] < 1:
            raise InvalidArgumentError(
                f"grads must have shape [{ids.shape[0]}, dim >= 1] to match ids, "
                f"got {list(grads.shape)}"
            )
        request = pb.UpdateRequest(
            ids=pack_u64(ids),
            grads=pack_f32(grads),
            dim=_check_dim(grads.shape[1]),
            generation=generation or 0,
            **self._replica,
        )
        # Sent again only while it cannot leave this process (the shard restarting) or the
        # shard says it is still loading its checkpoint: an update that reached a serving
        # shard may have been applied, and twice would be wrong.
        answer = call_with_retries(
            self.peer,
            self._stub.Update,
            request,
            timeout=self.timeout,
            retry_seconds=self.update_retry_seconds,
            resend=False,
            not_applied=_still_loading,
        )
        return int(answer.rows_updated)

    # ------------------------------------------------------------------ control
    def configure(
        self,
        optimizer: SGD | Adagrad | Adam | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        """Set the shard's optimizer and/or initialization (None leaves one unchanged)."""
        self._call(self._stub.Configure, settings_to_configure_request(optimizer, initialization))

    def dump(
        self, directory: str, *, timeout: float | None = None
    ) -> tuple[list[FileEntry], dict[str, Any] | None]:
        """Have the shard write ``directory/shard_{index:05d}/`` (a path the server sees);
        returns its file entries and its optimizer settings (for the manifest)."""
        response = self._call(
            self._stub.Dump,
            pb.ShardDumpRequest(directory=str(directory)),
            timeout or self.checkpoint_timeout,
        )
        entries = [
            FileEntry(
                shard=f.shard,
                dim=f.dim,
                path=f.path,
                rows=f.rows,
                state_width=f.state_width,
                bytes=f.bytes,
                sha256=f.sha256,
            )
            for f in response.files
        ]
        optimizer = json.loads(response.optimizer_json) if response.optimizer_json else None
        return entries, optimizer

    def load(
        self,
        directory: str,
        *,
        timeout: float | None = None,
        caller_gone: Callable[[], bool] | None = None,
    ) -> int:
        """Replace the shard's rows by its part of checkpoint ``directory``; rows loaded.

        The shard reads every row before it replaces any: a failed load leaves its rows.
        ``caller_gone``: asked every 0.1 s while the shard loads; once true, the call is
        cancelled, and the shard abandons the load unless it was already swapping rows in
        (DeadlineExceededError here either way: the outcome is no longer anyone's answer).
        """
        request = pb.ShardLoadRequest(directory=str(directory))
        deadline = timeout or self.checkpoint_timeout
        if caller_gone is None:
            return int(self._call(self._stub.Load, request, deadline).rows_loaded)
        future = self._stub.Load.future(request, timeout=deadline)
        try:
            while True:  # ends with the call at the latest, which has a deadline
                try:
                    return int(future.result(timeout=_CALLER_CHECK_SECONDS).rows_loaded)
                except grpc.FutureTimeoutError:
                    if caller_gone():
                        future.cancel()
                        raise DeadlineExceededError(
                            f"{self.peer}: load of {directory} cancelled: its caller gave up"
                        ) from None
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.peer) from None

    def export_rows(
        self, max_rows_per_chunk: int = 65536, *, timeout: float | None = None
    ) -> Iterator[RowBlock]:
        """Every row of the shard as copied at one instant (training may go on meanwhile),
        as blocks of at most ``max_rows_per_chunk`` rows of one dim (with optimizer state),
        each dim's least recently used first. The stream's deadline covers the whole
        iteration."""
        if not isinstance(max_rows_per_chunk, int) or max_rows_per_chunk < 1:
            raise InvalidArgumentError(
                f"max_rows_per_chunk must be a positive integer, got {max_rows_per_chunk!r}"
            )
        stream = self._stub.ExportRows(
            pb.ExportRowsRequest(max_rows_per_chunk=max_rows_per_chunk),
            timeout=timeout or self.checkpoint_timeout,
        )
        return self._blocks_of(stream)

    def _blocks_of(self, stream: _RowChunkStream) -> Iterator[RowBlock]:
        index = 0
        try:
            for chunk in stream:
                try:
                    block = row_block_from_chunk(chunk, f"RowChunk[{index}]")
                except InvalidArgumentError as error:
                    raise RecserveError(
                        f"{self.peer} sent a malformed row chunk: {error.message}"
                    ) from None
                index += 1
                yield block
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.peer) from None
        finally:
            stream.cancel()  # no-op when complete; frees the call when the caller stops early

    def import_rows(self, blocks: Iterable[RowBlock], *, timeout: float | None = None) -> int:
        """Stream ``blocks`` into the shard (insert or overwrite); returns the rows imported.

        Blocks are imported one by one as they arrive: on an error, earlier ones stay.
        """
        failure: list[BaseException] = []

        def chunks() -> Iterator[pb.RowChunk]:
            try:
                for block in blocks:
                    if not isinstance(block, RowBlock):
                        raise InvalidArgumentError(
                            f"import_rows needs RowBlock items, got {type(block).__name__}"
                        )
                    yield from row_chunks(block, 0)
            except BaseException as error:
                failure.append(error)
                raise

        try:
            response = self._stub.ImportRows(chunks(), timeout=timeout or self.checkpoint_timeout)
        except grpc.RpcError as error:
            if failure:  # the blocks failed on this side; gRPC only saw a cancelled call
                raise failure[0] from None
            raise error_from_rpc(error, self.peer) from None
        return int(response.rows_imported)

    def clear(self) -> None:
        """Drop every row of the shard."""
        self._call(self._stub.Clear, pb.ClearRequest())

    def status(self, *, timeout: float | None = None) -> ShardStatus:
        """What the shard reports (deadline ``timeout`` s; None: the client's timeout; at
        most the time left before :data:`caller_deadline`)."""
        timeout = self._within_caller_deadline(self.timeout if timeout is None else timeout)
        answer = self._call(self._stub.Status, pb.ShardStatusRequest(), timeout)
        try:
            return ShardStatus.from_proto(answer)
        except ConfigError as error:
            raise RecserveError(f"{self.peer} sent a malformed answer: {error.message}") from None

    def health(self, service: str = SERVICE_NAME, *, timeout: float | None = None) -> str:
        """The health status name (``"SERVING"``, ``"NOT_SERVING"``, ...) of ``service``."""
        response = self._call(
            self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_for_serving(self, timeout: float) -> None:
        """Poll the health service until the shard is SERVING; UnavailableError on timeout."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(
                    f"{self.peer} did not become SERVING within {timeout:g} s (last: {last})"
                )
            try:
                last = self.health(timeout=max(0.05, min(remaining, 1.0)))
                if last == "SERVING":
                    return
            except RecserveError as error:
                last = error.message
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
