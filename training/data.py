"""Getting batches to NN workers: streamed from data-loader processes, or read locally.

* :class:`DataCtx` (data-loader process) sends batches straight to the NN workers over gRPC.
  Global batch number ``g = sequence * replica_size + replica_index`` goes to NN worker
  ``g % world_size``: routing is deterministic, and a blocked send is the backpressure.
* :class:`StreamingDataset` (NN worker) receives them into a bounded buffer and ends cleanly
  when every data loader has said it is done.
* :class:`IterableDataset` wraps local batches (tests, evaluation, the embedded default).
* :class:`DataLoader` iterates a dataset with a bounded prefetch thread.

Peers are given by address (``RECSERVE_NN_WORKER_ADDRESSES``): there is no broker.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from embedding_store.batch import Batch
from embedding_store.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import (
    bind_tier_port,
    call,
    channel_options,
    format_address,
    rpc_errors,
    server_interceptors,
    server_options,
    tier_channel,
    tier_tls,
)
from training import distributed
from training.env import NN_WORKERS_ENV, NUM_LOADERS_ENV, REPLICA_INDEX_ENV, REPLICA_SIZE_ENV
from training.proto import data_stream_pb2 as pb
from training.proto import data_stream_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _addresses_from_env() -> list[str]:
    return [a.strip() for a in os.environ.get(NN_WORKERS_ENV, "").split(",") if a.strip()]


def _replica_from_env(name: str, default: str) -> int:
    """The integer in environment variable ``name`` (``default`` when unset);
    InvalidArgumentError naming the variable and its text when it is not one."""
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer, got {text!r}") from None


def _own_port(address: str) -> tuple[str, int]:
    """(host, port) of ``address``, this rank's ``HOST:PORT`` entry of NN_WORKERS_ENV;
    InvalidArgumentError naming the variable and the entry unless the port is 1..65535."""
    host, _, port = address.rpartition(":")
    if not (port.isdigit() and port.isascii() and 0 < int(port) < 65536):
        raise InvalidArgumentError(
            f"{NN_WORKERS_ENV}: {address!r} is not HOST:PORT with a port in 1..65535"
        )
    return host, int(port)


class DataCtx:
    """Data-loader side: ``with DataCtx() as ctx: ctx.send_data(batch)``.

    ``nn_worker_addresses`` default to ``RECSERVE_NN_WORKER_ADDRESSES`` (rank order);
    ``replica_index`` / ``replica_size`` to ``RECSERVE_REPLICA_INDEX`` / ``..._SIZE``.
    Sends wait up to ``timeout`` seconds for an NN worker to come up (before its first batch)
    or to make room; a worker that took batches and can no longer be reached fails the send
    at once (UnavailableError), as its training has stopped.
    """

    def __init__(
        self,
        nn_worker_addresses: Sequence[str] | None = None,
        *,
        replica_index: int | None = None,
        replica_size: int | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.addresses = list(nn_worker_addresses or _addresses_from_env())
        if not self.addresses:
            raise InvalidArgumentError(
                f"no NN worker addresses: pass nn_worker_addresses or set {NN_WORKERS_ENV}"
            )
        self.replica_index = (
            _replica_from_env(REPLICA_INDEX_ENV, "0")
            if replica_index is None
            else int(replica_index)
        )
        self.replica_size = (
            _replica_from_env(REPLICA_SIZE_ENV, "1") if replica_size is None else int(replica_size)
        )
        if not 0 <= self.replica_index < self.replica_size:
            raise InvalidArgumentError(
                f"replica index {self.replica_index} is not within replica size {self.replica_size}"
            )
        self.timeout = timeout
        self._channels = [tier_channel(a, channel_options()) for a in self.addresses]
        self._stubs = [pb_grpc.DataReceiverStub(c) for c in self._channels]
        self._sequence = 0
        self._sent = [0] * len(self.addresses)
        self._finished = False

    def target_of(self, sequence: int) -> int:
        """NN worker that receives this loader's batch number ``sequence``."""
        return (sequence * self.replica_size + self.replica_index) % len(self.addresses)

    def send_data(self, batch: Batch) -> None:
        """Send one batch to its NN worker; blocks while that worker's buffer is full."""
        if self._finished:
            # The workers counted this loader's batches at its end: one more would be lost.
            raise FailedPreconditionError("send_data() after finish(): this loader has ended")
        target = self.target_of(self._sequence)
        request = pb.SendBatchRequest(
            loader_index=self.replica_index, sequence=self._sequence, batch=batch.to_bytes()
        )
        # Until a worker took a first batch it may still be starting: wait for it. After
        # that, a worker that cannot be reached has gone (its training ended or failed):
        # fail now rather than wait out the whole timeout.
        first = self._sent[target] == 0
        try:
            self._stubs[target].SendBatch(request, timeout=self.timeout, wait_for_ready=first)
        except grpc.RpcError as error:
            from embedding_store.grpc_common import error_from_rpc

            gone = "" if first else " (it took batches before: has its training stopped?)"
            if first and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Waiting for it hides why: not started, or a TLS handshake that fails.
                gone = (
                    " (never reached: is it started, with the same RECSERVE_TIER_TLS_* "
                    "settings as this loader?)"
                )
            raise error_from_rpc(error, f"NN worker {self.addresses[target]}{gone}") from None
        self._sequence += 1
        self._sent[target] += 1

    def finish(self) -> None:
        """Tell every NN worker that this loader is done (called on context exit; once: a
        second call, or the exit after one, sends nothing)."""
        if self._finished:
            return
        for index, stub in enumerate(self._stubs):
            request = pb.EndOfStreamRequest(
                loader_index=self.replica_index, batches_sent=self._sent[index]
            )
            call(f"NN worker {self.addresses[index]}", stub.EndOfStream, request, timeout=60)
        self._finished = True

    def abort(self, failure: str) -> None:
        """Tell every NN worker that this loader stopped on ``failure`` (called on context
        exit by an exception): each fails its iteration at once, naming this loader and the
        error, rather than wait ``idle_timeout`` for batches that will never come. Best
        effort: a worker that cannot be told within a few seconds is logged, and falls back
        on its idle timeout."""
        for index, stub in enumerate(self._stubs):
            request = pb.EndOfStreamRequest(
                loader_index=self.replica_index,
                batches_sent=self._sent[index],
                failure=failure or "unknown error",
            )
            try:
                call(
                    f"NN worker {self.addresses[index]}",
                    stub.EndOfStream,
                    request,
                    timeout=_ABORT_TIMEOUT_SECONDS,
                )
            except RecserveError as error:
                log.warning("could not report this loader's failure: %s", error.message)

    def __enter__(self) -> DataCtx:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None = None,
        *rest: object,
    ) -> None:
        try:
            if exc_type is None:
                self.finish()
            else:
                what = getattr(exc, "message", None) or str(exc or "")
                self.abort(f"{exc_type.__name__}: {what}" if what else exc_type.__name__)
        finally:
            for channel in self._channels:
                channel.close()


#: Seconds a failing loader gives each NN worker to take the news (DataCtx.abort).
_ABORT_TIMEOUT_SECONDS = 5.0

#: How often a receiver waiting for room in a full buffer checks that the dataset is open.
_PUT_POLL_SECONDS = 0.1

#: Seconds a StreamingDataset waits for the next batch before it gives up on its loaders.
DEFAULT_IDLE_TIMEOUT = 300.0
_END = object()


class _LoaderFailed:
    """Queued by a loader's EndOfStream with a failure: the iteration raises it."""

    def __init__(self, error: UnavailableError) -> None:
        self.error = error


class _Receiver(pb_grpc.DataReceiverServicer):
    """Puts received batches into the dataset's bounded buffer (blocking = backpressure)."""

    def __init__(self, dataset: StreamingDataset) -> None:
        self.dataset = dataset

    @rpc_errors
    def SendBatch(
        self, request: pb.SendBatchRequest, context: grpc.ServicerContext
    ) -> pb.SendBatchResponse:
        batch = Batch.from_bytes(request.batch)
        self.dataset._accept(request.loader_index, request.sequence, batch, context)
        return pb.SendBatchResponse()

    @rpc_errors
    def EndOfStream(
        self, request: pb.EndOfStreamRequest, context: grpc.ServicerContext
    ) -> pb.EndOfStreamResponse:
        self.dataset._end(
            request.loader_index, request.batches_sent, request.failure, context.peer()
        )
        return pb.EndOfStreamResponse()


def _num_loaders(num_loaders: int | None) -> int:
    """``num_loaders``, else ``$RECSERVE_NUM_DATA_LOADERS``, else 1; InvalidArgumentError
    unless it is an integer >= 1 (with 0 loaders the stream would end before it began)."""
    if num_loaders is None:
        text = os.environ.get(NUM_LOADERS_ENV, "1")
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgumentError(
                f"{NUM_LOADERS_ENV} must be an integer >= 1, got {text!r}"
            ) from None
        where = NUM_LOADERS_ENV
    else:
        try:
            if isinstance(num_loaders, bool):
                raise TypeError
            value = operator.index(num_loaders)  # ints, numpy ints; not 1.5 nor "2"
        except TypeError:
            raise InvalidArgumentError(
                f"num_loaders must be an integer >= 1, got {num_loaders!r}"
            ) from None
        where = "num_loaders"
    if value < 1:
        raise InvalidArgumentError(
            f"{where} must be >= 1 (the data loaders streaming batches), got {value}"
        )
    return value


class StreamingDataset:
    """NN-worker side of the stream: an iterable of batches sent by data-loader processes.

    Listens on the port of this rank's entry in ``RECSERVE_NN_WORKER_ADDRESSES`` (or
    ``port``). Ends after all ``num_loaders`` loaders (``RECSERVE_NUM_DATA_LOADERS``, default
    1) sent EndOfStream. ``reproducible=True`` yields batches in global order whatever the
    arrival order (loaders then advance in lock step). When no batch arrives for
    ``idle_timeout`` seconds while some loader has not ended, iteration raises
    UnavailableError naming those loaders: a loader that died never sends EndOfStream, and
    the training would otherwise wait for it forever.
    """

    def __init__(
        self,
        buffer_size: int = 10,
        *,
        port: int | None = None,
        host: str | None = None,
        num_loaders: int | None = None,
        reproducible: bool = False,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    ) -> None:
        if buffer_size < 1:
            raise InvalidArgumentError(f"buffer_size must be >= 1, got {buffer_size}")
        if not idle_timeout > 0 or math.isinf(idle_timeout):
            raise InvalidArgumentError(f"idle_timeout must be a number > 0, got {idle_timeout}")
        self.idle_timeout = float(idle_timeout)
        addresses = _addresses_from_env()
        rank, world = distributed.rank(), max(distributed.world_size(), 1)
        if port is None:
            if not addresses:
                raise InvalidArgumentError(
                    f"StreamingDataset needs a port: pass port= or set {NN_WORKERS_ENV}"
                )
            if "WORLD_SIZE" in os.environ and len(addresses) != world:
                # (torchrun sets WORLD_SIZE.) Loaders deal batches over every entry, and
                # each rank takes its own: any other count loses or stalls batches.
                raise InvalidArgumentError(
                    f"{NN_WORKERS_ENV} has {len(addresses)} address(es) but WORLD_SIZE is "
                    f"{world}: give one HOST:PORT per NN worker, in rank order"
                )
            own_host, port = _own_port(addresses[rank % len(addresses)])
            host = host or (own_host if own_host.startswith("127.") else "0.0.0.0")
            world = len(addresses)
        self.host = host or "127.0.0.1"
        self.port = port
        self.num_loaders = _num_loaders(num_loaders)
        self.reproducible = reproducible
        self._rank, self._world = rank % world, world
        self._buffer: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._ended: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._peers: dict[int, str] = {}  # each loader's last gRPC peer ("ipv4:HOST:PORT")
        self._lock = threading.Condition()
        self._next_global = self._rank  # reproducible mode: the next global batch number
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None  # the receiver's handler threads
        self._closed = threading.Event()  # the consumer is gone: handlers stop waiting

    def start(self) -> StreamingDataset:
        """Start listening (iteration starts it too); returns self."""
        if self._server is None:
            tier_tls()  # bad RECSERVE_TIER_TLS_* fail here, before anything is bound
            self._closed.clear()
            self._executor = ThreadPoolExecutor(max_workers=self.num_loaders + 4)
            server = grpc.server(
                self._executor,
                options=server_options(),
                interceptors=server_interceptors(),
            )
            pb_grpc.add_DataReceiverServicer_to_server(_Receiver(self), server)
            try:
                self.port = bind_tier_port(server, format_address(self.host, self.port))
            except UnavailableError as error:
                raise UnavailableError(f"StreamingDataset {error.message}") from None
            server.start()
            self._server = server
        return self

    def _accept(
        self, loader: int, sequence: int, batch: Batch, context: grpc.ServicerContext
    ) -> None:
        if not 0 <= loader < self.num_loaders:
            raise InvalidArgumentError(
                f"SendBatchRequest.loader_index {loader} is not below num_loaders "
                f"{self.num_loaders}"
            )
        self._peers[loader] = context.peer()  # named when it stalls or fails
        if self.reproducible:
            number = sequence * self.num_loaders + loader
            with self._lock:
                while number != self._next_global:
                    if not context.is_active():
                        return
                    self._lock.wait(timeout=1.0)
                self._next_global += self._world
                # The next number may be an ended loader's: skip it, or every later batch
                # would wait for one that never comes.
                self._skip_ended_loaders()
                self._put(batch)
                self._received[loader] = self._received.get(loader, 0) + 1
                self._lock.notify_all()
            return
        self._put(batch)
        with self._lock:
            self._received[loader] = self._received.get(loader, 0) + 1

    def _end(self, loader: int, batches_sent: int, failure: str = "", peer: str = "") -> None:
        if failure:
            # Not the end of its data: the run cannot be complete, so the iteration fails
            # once the batches before it are read (a crash that said nothing is caught by
            # the idle timeout instead).
            with self._lock:
                received = self._received.get(loader, 0)
            self._put(
                _LoaderFailed(
                    UnavailableError(
                        f"data loader {loader} ({peer or 'unknown peer'}) failed after "
                        f"sending {batches_sent} batch(es) to this NN worker "
                        f"({self.host}:{self.port}, {received} arrived): {failure}"
                    )
                )
            )
            return
        if not 0 <= loader < self.num_loaders:
            # Counted as an end, it would stop the stream while a real loader still sends (a
            # failure above is reported whatever its index: it never counts as an end).
            raise InvalidArgumentError(
                f"EndOfStreamRequest.loader_index {loader} is not below num_loaders "
                f"{self.num_loaders}"
            )
        with self._lock:
            if self._received.get(loader, 0) != batches_sent:
                raise InvalidArgumentError(
                    f"data loader {loader} says it sent {batches_sent} batches, "
                    f"{self._received.get(loader, 0)} arrived"
                )
            if loader in self._ended:
                # A second end of the same loader (DataCtx.finish called by hand, then on
                # exit): counted twice, it ended the stream before the other loaders did.
                return
            self._ended[loader] = batches_sent
            if self.reproducible:
                # Other loaders' later batches no longer wait for this one's.
                self._skip_ended_loaders()
                self._lock.notify_all()
        self._put(_END)

    def _skip_ended_loaders(self) -> None:
        # This rank's numbers step by world size, so their loaders (g % num_loaders) repeat
        # within num_loaders steps: past that, every loader that feeds this rank has ended.
        # Only some loaders may feed it (2 loaders, 2 ranks: loader i sends to rank i
        # alone), so "until every loader ended" looped for good, holding the lock.
        for _ in range(self.num_loaders):
            if self._next_global % self.num_loaders not in self._ended:
                return
            self._next_global += self._world

    def __iter__(self) -> Iterator[Batch]:
        self.start()
        ended = 0
        try:
            while ended < self.num_loaders:
                try:
                    item = self._buffer.get(timeout=self.idle_timeout)
                except queue.Empty:
                    raise self._stalled() from None
                if item is _END:
                    ended += 1
                    continue
                if isinstance(item, _LoaderFailed):
                    raise item.error
                yield item
        finally:
            self.close()

    def _stalled(self) -> UnavailableError:
        with self._lock:
            waiting = [i for i in range(self.num_loaders) if i not in self._ended]
            received = {i: self._received.get(i, 0) for i in waiting}
            peers = {i: self._peers[i] for i in waiting if i in self._peers}
        never = [i for i in waiting if i not in peers]
        seen = f"; last seen from: {peers}" if peers else ""
        unseen = f"; never connected: {never}" if never else ""
        return UnavailableError(
            f"no batch from the data loaders for {self.idle_timeout:g} s, and loader(s) "
            f"{waiting} have not ended their stream (batches received from each: {received}"
            f"{seen}{unseen}): a loader stopped or cannot reach this NN worker "
            f"({self.host}:{self.port})"
        )

    def _put(self, item: object) -> None:
        """Queue ``item``, waiting while the buffer is full (backpressure) until the dataset
        closes. A handler blocked in a plain put outlived the closed server (the consumer
        broke out or failed): the executor's thread is joined at interpreter exit, and the
        NN worker never exited."""
        while True:
            try:
                self._buffer.put(item, timeout=_PUT_POLL_SECONDS)
                return
            except queue.Full:
                if self._closed.is_set():
                    raise UnavailableError(
                        f"the NN worker ({self.host}:{self.port}) stopped reading batches"
                    ) from None

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.stop(grace=1.0)
            self._server = None


class IterableDataset:
    """Local batches: an iterable, or a zero-argument callable returning a fresh iterator
    (so the dataset can be iterated once per epoch)."""

    def __init__(self, source: Iterable[Batch] | Callable[[], Iterable[Batch]]) -> None:
        self.source = source
        self._exhausted = False  # a one-shot iterator source was read to its end

    def __iter__(self) -> Iterator[Batch]:
        if callable(self.source):
            return iter(self.source())
        batches = iter(self.source)
        if batches is not self.source:  # a collection: each pass reads it all again
            return batches
        if self._exhausted:
            # A generator gives nothing the second time: a second epoch trained on no
            # batch at all, and said nothing.
            raise FailedPreconditionError(
                "IterableDataset: its source is an iterator (a generator?) that an earlier "
                "pass read to its end, so it has no batch left; pass a function returning a "
                "fresh iterator (IterableDataset(lambda: make_batches())) to read it once per "
                "epoch"
            )
        return self._to_the_end(batches)

    def _to_the_end(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        # Not `yield from`: closing a pass left early would close the source with it, and a
        # later pass could not go on where this one stopped.
        for batch in batches:  # noqa: UP028 (see above)
            yield batch
        self._exhausted = True


class DataLoader:
    """Iterates a dataset with a bounded background prefetch (order is preserved).

    ``equal_steps``: end every rank's iteration at the same step, dropping the remainder,
    so DDP never waits for a rank that ran out of batches (its allreduce would fail). Each
    step then costs one small all-reduce. Default (None): on for a :class:`StreamingDataset`
    in a distributed run, whose loaders deal batches round-robin (33 batches over 2 ranks is
    17 and 16); local datasets split their batches evenly themselves.
    """

    def __init__(
        self, dataset: Iterable[Batch], *, prefetch: int = 4, equal_steps: bool | None = None
    ) -> None:
        if prefetch < 0:
            raise InvalidArgumentError(f"prefetch must be >= 0, got {prefetch}")
        self.dataset = dataset
        self.prefetch = prefetch
        # The last pass's prefetch thread and its stop event.
        self._producer: tuple[threading.Thread, threading.Event] | None = None
        if equal_steps is None:
            equal_steps = isinstance(dataset, StreamingDataset) and distributed.world_size() > 1
        self.equal_steps = equal_steps

    def __iter__(self) -> Iterator[Batch]:
        batches = self._prefetched()
        return _equal_steps(batches) if self.equal_steps else batches

    def _prefetched(self) -> Iterator[Batch]:
        if self.prefetch == 0:
            yield from self.dataset
            return
        previous = self._producer
        if previous is not None:
            # A pass left early (a break) may have left its producer inside the source: a
            # shared iterator must not be read by two threads ("generator already
            # executing"). It ends once that read returns, having seen the stop. A pass
            # still open (an iterator kept after a peek with next()) is stopped first: its
            # producer waited for room in its full buffer for good, and this join with it.
            thread, previous_stop = previous
            previous_stop.set()
            thread.join()
        buffer: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        failure: list[BaseException] = []

        def put(item: object) -> bool:
            """Queue ``item`` unless the consumer stopped (nobody drains the queue then: a
            plain put could block for good); whether it was queued."""
            while not stop.is_set():
                try:
                    buffer.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in self.dataset:
                    if not put(batch):
                        return
            except BaseException as error:
                failure.append(error)
            finally:
                put(_END)

        thread = threading.Thread(target=produce, name="data-prefetch", daemon=True)
        self._producer = (thread, stop)
        thread.start()
        try:
            while True:
                try:
                    item = buffer.get(timeout=_PUT_POLL_SECONDS)
                except queue.Empty:
                    if stop.is_set():  # only a newer pass sets it while this one reads
                        raise FailedPreconditionError(
                            "a new pass over this DataLoader began before this one ended: "
                            "this one stopped (one pass at a time)"
                        ) from None
                    continue
                if item is _END:
                    break
                yield item
            if failure:
                raise failure[0]
        finally:
            # The consumer stopped (the end, a break, an error). A producer blocked in the
            # source (a slow generator, a StreamingDataset waiting for loaders) cannot see
            # `stop` until the source yields: it is not waited for. It is a daemon thread
            # and ends by itself at the source's next batch (dropped) or end.
            stop.set()
            deadline = time.monotonic() + _PRODUCER_GRACE_SECONDS
            while thread.is_alive() and time.monotonic() < deadline:
                try:
                    buffer.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.01)


#: How long a stopped DataLoader waits for its producer thread before leaving it.
_PRODUCER_GRACE_SECONDS = 0.2


def _equal_steps(batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches`` for as long as every rank has one: each step, the ranks agree (one
    all-reduce) that all of them have a batch; once one has none, all stop. The batches this
    rank has left are read to the end (so its data loaders finish) and dropped."""
    for batch in batches:
        if distributed.all_agree(True):
            yield batch
            continue
        dropped = 1 + sum(1 for _ in batches)
        log.warning(
            "rank %d dropped its last %d batch(es): another rank ran out first, and every "
            "rank must run the same number of steps",
            distributed.rank(),
            dropped,
        )
        return
    distributed.all_agree(False)
