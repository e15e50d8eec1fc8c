"""The prediction service: the one core object behind the HTTP and gRPC front ends.

It validates requests against the served model's signature, merges concurrent requests
(:class:`DynamicBatcher`), answers with the version that computed them, keeps readiness honest
(model loaded and warmed, embedding tier answering, not shutting down), records metrics, and
swaps in new checkpoint versions atomically (:meth:`reload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from embedding_store import __version__
from embedding_store.batch import Batch
from embedding_store.errors import (
    PREPROCESSOR_INPUT_ERRORS,
    CheckpointError,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelInputError,
    NotFoundError,
    RecserveError,
    UnavailableError,
    summary_with_origin,
)
from embedding_store.gc_tuning import collect_released_objects, freeze_long_lived_objects
from embedding_store.tier import DownReasons, InProcessEmbeddingTier
from embedding_store.tier_types import TierStatus
from serving import instance_inputs, tensor_specs, tensors
from serving.batcher import DEADLINE_SLACK_SECONDS, DROP_REASONS, BatchOutcome, DynamicBatcher
from serving.core import ModelMetadata, Prediction, ServerMetadata
from serving.loop_batcher import LoopBatcher
from serving.metrics import COMMON_OUTCOMES, PROTOCOLS, ServingMetrics
from serving.model import LoadedModel, error_summary, worker_config_mismatch

log = logging.getLogger(__name__)

#: The ``model`` label of requests that named a model this server does not serve.
UNKNOWN_MODEL_LABEL = "unknown"

#: How long close() waits for a batch still running before it closes the model anyway.
CLOSE_WAIT_SECONDS = 5.0

#: The longest a request waits for its answer, whatever deadline it asks for (one day).
MAX_WAIT_SECONDS = 24 * 3600.0

#: A call that its front end reports gone within this many seconds of its deadline is
#: counted as past its deadline (DeadlineExceededError), not as cancelled by its client:
#: gRPC ends a call at the client's deadline, a hair before the core's own wait runs out.
_DEADLINE_SLACK_SECONDS = DEADLINE_SLACK_SECONDS

#: What a front end passes as ``on_cancel``: it registers a callback to run once the call
#: ends (gRPC's ``ServicerContext.add_callback``) and returns False if it already has.
CancelHook = Callable[[Callable[[], None]], bool]


def _deadline(wait: float) -> DeadlineExceededError:
    return DeadlineExceededError(f"no answer within the request deadline of {wait:.3f} s")


def _share(total: int, part: int, whole: int) -> int:
    """``total`` apportioned to ``part`` of ``whole`` (exact when part == whole)."""
    if part >= whole or whole == 0:
        return total
    return round(total * part / whole)


def _own_unknown(
    merged_unknown: int,
    per_sample: np.ndarray | None,
    offset: int,
    size: int,
    own_ids: int,
    merged_ids: int,
) -> int:
    """A request's unknown IDs: those of its own samples (rows ``offset`` to ``offset +
    size`` of the merged batch; ``per_sample`` int64 [merged batch]), exactly what it gets
    alone. Apportioned by its share of the merged batch's IDs only where the tier could not
    split the count by sample (None: a worker or shard that predates the split)."""
    if merged_unknown == 0 or own_ids >= merged_ids:
        return merged_unknown  # none, or the request is the whole batch
    if per_sample is None:
        return _share(merged_unknown, own_ids, merged_ids)
    return int(per_sample[offset : offset + size].sum())


def _cannot_serve_yet(tier: object, status: TierStatus) -> str | None:
    """Which shards answered ``status`` but cannot serve, as specifically as the server
    knows them: ``"embedding shard 1 (h:7001) cannot serve yet (loading)"`` (shards asked
    directly: serve --embedding-ps), ``"embedding worker w:7100: shard 1 (h:7001) cannot
    serve yet (loading)"`` (through an embedding worker: the one to ask, and the shard it
    reports), without the address for in-process shards or the task where none is reported;
    one per shard, joined by ``"; "``. None when every one serves."""
    addresses, tasks = status.shard_addresses, status.shard_tasks
    waiting = [
        f"shard {index}"
        + (f" ({addresses[index]})" if index < len(addresses) and addresses[index] else "")
        + " cannot serve yet"
        + (f" ({tasks[index]})" if index < len(tasks) and tasks[index] else "")
        for index, serving in enumerate(status.shard_serving)
        if not serving
    ]
    if not waiting:
        return None
    worker = getattr(tier, "address", None)  # a RemoteEmbeddingWorker's
    return (f"embedding worker {worker}: " if worker else "embedding ") + "; ".join(waiting)


def _refusal(error: Exception) -> str:
    """Why a preprocessor refused the instances, for the client. A KeyError's message is the
    bare key (``'age'``): most often an instance without the field the preprocessor reads,
    so it is named so; an error without a message is named by its type."""
    if isinstance(error, KeyError) and len(error.args) == 1:
        return f"missing key {error.args[0]!r} (the preprocessor raised KeyError)"
    return str(error) or f"the preprocessor raised {type(error).__name__}"  # none said why


#: How often each origin of a preprocessor's refusal (exception type, file, line) is logged
#: with its traceback: a bug in the operator's preprocessor shows in the default log, while
#: a client sending bad rows in a loop adds one warning per origin per interval.
PREPROCESSOR_ERROR_LOG_SECONDS = 300.0


class OriginLogLimiter:
    """Rate limit for log lines about exceptions: :meth:`admit` says whether an exception from
    this origin (its type, and the file and line of the innermost frame that raised it) is to
    be logged now, at most once per ``interval`` seconds per origin, with how many from that
    origin were left out since the last logged one. Thread-safe (the preprocessor runs in
    worker threads); remembers at most ``max_origins`` origins (origins are code lines, so
    few; the least recently logged is forgotten past that)."""

    def __init__(
        self,
        interval: float,
        *,
        max_origins: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self._max_origins = max_origins
        self._clock = clock
        self._lock = threading.Lock()
        self._logged: dict[tuple[str, str, int], tuple[float, int]] = {}  # -> (when, left out)

    @staticmethod
    def origin(error: BaseException) -> tuple[str, str, int]:
        """(type name, file, line) of the innermost frame of ``error``'s traceback."""
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None:
            return type(error).__qualname__, "?", 0
        return type(error).__qualname__, tb.tb_frame.f_code.co_filename, tb.tb_lineno

    def admit(self, error: BaseException) -> int | None:
        """None when ``error``'s origin was logged less than ``interval`` seconds ago (it is
        counted); otherwise how many from that origin were left out since (0 the first time):
        the caller logs it."""
        key, now = self.origin(error), self._clock()
        with self._lock:
            last = self._logged.get(key)
            if last is not None and now - last[0] < self.interval:
                self._logged[key] = (last[0], last[1] + 1)
                return None
            if last is None and len(self._logged) >= self._max_origins:
                del self._logged[min(self._logged, key=lambda k: self._logged[k][0])]
            self._logged[key] = (now, 0)
            return 0 if last is None else last[1]


class PredictionService:
    """Implements :class:`serving.core.PredictionCore` for one model name."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        loader: Callable[[str | None], LoadedModel] | None = None,
        max_batch_size: int = 256,
        max_request_batch_size: int = 4096,
        max_queue_delay: float = 0.002,
        max_queue_size: int = 1024,
        default_timeout: float = 10.0,
        metrics: ServingMetrics | None = None,
        preprocessor: Callable[[list[Mapping[str, Any]]], Batch] | None = None,
        tier_check_seconds: float = 2.0,
    ) -> None:
        # Before anything starts: a model whose inputs share a name cannot be served (a
        # reload keeps the signature, so the served model is the only one to check).
        tensor_specs.check_input_names(model.signature)
        self.name = model.name
        self._preprocessor = preprocessor
        self._model = model
        self._loader = loader
        self.max_request_batch_size = max_request_batch_size
        self.default_timeout = default_timeout
        self.metrics = metrics or ServingMetrics()
        # Labelled metric children by label values: labels() costs ~1 us a call, per request.
        self._request_counters: dict[tuple[str, str, str, str], Any] = {}
        self._request_latencies: dict[str, Any] = {}
        # Versions whose request series may exist: the served one, and a replaced one until
        # _forget_version. A series is only created (never on the per-request path: the
        # children are cached) under this lock for a live version, so a request answered by
        # a replaced version and counted after its series were removed cannot bring them
        # back for good.
        self._series_lock = threading.Lock()
        self._live_versions: set[str] = set()
        with self._series_lock:
            self._create_series(model.version)
        self._accepting = True
        self._closed = False  # close() ran: a reload that ends after it serves nothing
        self._reload_lock = threading.Lock()
        self.last_reload_error: str | None = None
        # One model call at a time, whichever batcher (thread or event loop) makes it.
        self._run_lock = threading.Lock()
        # Requests dropped before their batch ran, by reason (children cached: labels()
        # costs ~1 us).
        self._drop_counters = {
            reason: self.metrics.dropped_requests.labels(reason) for reason in DROP_REASONS
        }
        self._batcher = DynamicBatcher(
            self._run_locked,
            max_batch_size=max_batch_size,
            max_queue_delay=max_queue_delay,
            max_queue_size=max_queue_size,
            on_batch=self._observe_batch,
            on_drop=self._count_drop,
            on_split=self.metrics.split_batches.inc,
        )
        self._batch_limits = (max_batch_size, max_queue_delay, max_queue_size)
        # Requests decoded on an event loop are batched on that loop (predict_async).
        self._loop_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBatcher] = (
            weakref.WeakKeyDictionary()
        )
        self.metrics.track_pending(lambda: self.pending)
        self.metrics.track_checkpoint(lambda: self._model.created_unix)
        self.metrics.set_model(self.name, model.version)
        self.metrics.track(self.metrics.ready, lambda: 1.0 if self.ready() else 0.0)
        # The embedding tier is checked in the background (a probe never waits on a slow
        # peer) for a metric and the log, not for readiness: every server shares the tier, so
        # a restarting shard would take every server out of its Service at once, including
        # those that answer with default vectors (--fallback-policy default). Requests that
        # reach a shard that cannot serve fail naming it instead. Start-up waits for the tier.
        self._tier_down = DownReasons()
        self._preprocessor_errors = OriginLogLimiter(PREPROCESSOR_ERROR_LOG_SECONDS)
        self.metrics.track(self.metrics.tier_serving, lambda: 1.0 if self.tier_serving else 0.0)
        # Shards whose rows are another checkpoint's than the model's (index -> version).
        self._foreign_versions: dict[int, str] = {}
        self.metrics.track(
            self.metrics.tier_version_mismatch, lambda: float(len(self._foreign_versions))
        )
        self._stop_checks = threading.Event()
        self._tier_checker = threading.Thread(
            target=self._check_tier, args=(tier_check_seconds,), name="tier-check", daemon=True
        )
        self._tier_checker.start()

    def _check_tier(self, every: float) -> None:
        while not self._stop_checks.wait(every):
            model = self._model
            mismatch = None
            try:
                # serve --embedding-ps: the worker core runs here, and so does the worker's
                # own check of its shards (replica order, embedding config), as an
                # embedding-worker runs it every 2 s: a shard restarted with another config
                # has its lookups refused (not read from other rows) until it is right again.
                verify_shards = getattr(model.tier, "verify_shards", None)
                if verify_shards is not None:
                    verify_shards()
                status = model.tier.status()
                # A shard that answers but cannot serve yet (a restarted inference shard
                # still loading its checkpoint) fails every lookup that reaches it.
                waiting = _cannot_serve_yet(model.tier, status)
                self._compare_versions(status.shard_checkpoint_versions)
                # A worker restarted with another embedding config since the load checked it.
                mismatch = worker_config_mismatch(
                    getattr(model.tier, "address", "(in-process)"),
                    status.embedding_config,
                    model.embedding_config,
                    model.manifest.directory,
                )
                if mismatch is not None:
                    raise mismatch
                if waiting:
                    raise UnavailableError(waiting)
                if self._tier_down.up():
                    log.info("embedding tier serving again")
            except RecserveError as error:
                # Unless the service closing, or a reload, closed this model's channel under
                # the call ("cancelled the call"), which says nothing about the tier.
                if not self._stop_checks.is_set() and model is self._model:
                    self._note_tier_error(error.message, mismatch is not None)
            except Exception as error:
                # A reload closed this model's tier while it was being asked: ask the new
                # one at the next check. Otherwise a surprise (a bug, a peer's odd answer)
                # must not end the checks: recserve_embedding_tier_serving would keep its
                # last value (1) for the server's life. Logged with its traceback once per
                # new reason; the next check that passes says "serving again".
                if not self._stop_checks.is_set() and model is self._model:
                    message = f"checking the embedding tier failed: {error_summary(error)}"
                    if self._tier_down.reason != message:
                        log.exception("checking the embedding tier failed")
                    self._note_tier_error(message, False)
            del model  # no reference to a replaced model between checks

    def _note_tier_error(self, message: str, wrong_config: bool) -> None:
        """The tier is not serving this model, for ``message``; logged when the reason
        changes too (a shard back from a crash as an empty, unconfigured one is another
        problem than the crash). ``wrong_config``: its worker routes IDs by another config."""
        if self._tier_down.down(message):
            if wrong_config:
                log.error(
                    "embedding tier not serving this model (its IDs read other rows, unknown "
                    "ones as zeros, so its predictions are wrong until the worker runs the "
                    "checkpoint's config): %s",
                    message,
                )
            else:
                log.warning(
                    "embedding tier not serving (requests that need it fail or get default "
                    "vectors, as --fallback-policy says): %s",
                    message,
                )

    def _compare_versions(self, versions: tuple[str, ...]) -> None:
        """Note shards that hold another embedding checkpoint than the served model's (a
        rollout half done, or a ConfigMap left on the old directory: docs/deploy.md). Shards
        that do not say (``""``: training shards, older builds) are not counted."""
        model = self._model
        expected = model.embedding_version
        foreign = {
            index: version
            for index, version in enumerate(versions)
            if version and expected and version != expected
        }
        if foreign == self._foreign_versions:
            return
        if foreign:
            held = ", ".join(f"shard {i}: {v}" for i, v in sorted(foreign.items()))
            log.warning(
                "embedding shards hold another checkpoint's rows (%s) than model %s version %s "
                "(embeddings %s, from %s): predictions mix two versions until the shards load "
                "this checkpoint's embeddings or the server loads theirs",
                held,
                model.name,
                model.version,
                expected,
                model.manifest.embeddings_directory,
            )
        else:
            log.info("embedding shards hold the served model's embeddings (%s) again", expected)
        self._foreign_versions = foreign

    @property
    def foreign_embedding_versions(self) -> dict[int, str]:
        """Shards (index -> version) that held another embedding checkpoint than the served
        model's at the last background check."""
        return dict(self._foreign_versions)

    # ------------------------------------------------------------------ state
    @property
    def model(self) -> LoadedModel:
        return self._model

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Model loaded and warmed (it is, once constructed) and not shutting down. The
        embedding tier's state is ``tier_serving`` (the metric), not readiness."""
        return self._accepting

    @property
    def tier_serving(self) -> bool:
        """Every embedding shard answered and served at the last background check."""
        return self._tier_down.reason is None

    @property
    def last_tier_error(self) -> str | None:
        """Why the embedding tier did not serve this model at the last background check
        (None: it did)."""
        return self._tier_down.reason

    def stop_accepting(self) -> None:
        """Readiness goes false (load balancers stop sending); queued work still finishes."""
        self._accepting = False

    @property
    def pending(self) -> int:
        """Requests queued or being computed, in the thread batcher and on event loops."""
        on_loops = sum(batcher.pending for batcher in list(self._loop_batchers.values()))
        return self._batcher.pending + on_loops

    def drain(self, grace: float) -> bool:
        """Wait up to ``grace`` seconds for queued and running requests."""
        self.stop_accepting()
        deadline = time.monotonic() + grace
        if not self._batcher.drain(grace):
            return False
        while self.pending:  # requests batched on the HTTP loop finish there
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def fail_queued(self) -> None:
        """Refuse new requests and answer those still queued, on every path, with
        UnavailableError (503 / UNAVAILABLE) now: what a stop does when its drain ran out of
        grace, before its front ends close (their connections would otherwise be cut, or
        the HTTP server's cancelled handlers answered 500). Batches being computed finish."""
        self._accepting = False
        self._batcher.fail_queued()
        for loop, batcher in list(self._loop_batchers.items()):
            error = UnavailableError("the server stopped before this request's batch ran")
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing waits on it
                loop.call_soon_threadsafe(batcher.fail_waiting, error)

    def close(self, wait: float = CLOSE_WAIT_SECONDS) -> None:
        """Refuse new requests on every path, stop the background work, close the models
        (replaced ones are closed by the reload that replaced them). A batch still running
        (a slow tier, past the drain) gets up to ``wait`` seconds to finish before its
        model's channels close under it; requests still queued fail (UnavailableError)."""
        deadline = time.monotonic() + wait
        self.fail_queued()
        self._stop_checks.set()
        self._batcher.close(timeout=wait)
        if self._run_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._run_lock.release()
        else:
            log.warning("closing the model while a batch still runs (after %.1f s)", wait)
        with self._series_lock:  # one step with a reload's swap: each model closed once
            self._closed = True
            model = self._model
        model.close()

    @property
    def reloading(self) -> bool:
        """A reload (the watcher's, an admin request's) is loading or swapping now."""
        return self._reload_lock.locked()

    def wait_for_reload(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a reload in progress to end; True when none runs.
        A process must not exit while one loads: interpreter shutdown ends its thread
        inside torch's native code, which aborts the process (SIGABRT)."""
        if not self._reload_lock.acquire(timeout=max(0.0, timeout)):
            return False
        self._reload_lock.release()
        return True

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> ServerMetadata:
        # The binary tensor data extension (HTTP) is the only optional one served.
        return ServerMetadata(
            name="recserve", version=__version__, extensions=("binary_tensor_data",)
        )

    def _check_name(self, name: str, version: str | None) -> LoadedModel:
        model = self._model
        if name != self.name:
            raise NotFoundError(f"unknown model {name!r}; this server serves {self.name!r}")
        if version not in (None, "", model.version):
            raise NotFoundError(
                f"model {name!r} has no version {version!r}; the served version is "
                f"{model.version!r}"
            )
        return model

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        model = self._check_name(name, version)
        return ModelMetadata(
            name=self.name,
            versions=(model.version,),
            platform="recserve_torchscript",
            inputs=tensor_specs.input_specs(model.signature),
            outputs=tensor_specs.output_specs(),
            max_batch_size=self.max_request_batch_size,
        )

    def model_ready(self, name: str, version: str | None = None) -> bool:
        self._check_name(name, version)
        return self.ready()

    # ------------------------------------------------------------------ prediction
    def _observe_batch(self, size: int, _started: float) -> None:
        self.metrics.batch_size.observe(size)

    def _count_drop(self, reason: str) -> None:
        self._drop_counters[reason].inc()

    def _log_input_error(self, error: RecserveError) -> None:
        """A request is answered a ModelInputError (400): its message goes to the client,
        the model's error with its traceback to the log (once per request: a merged batch
        that failed on it ran its requests alone, and the one that failed alone is it)."""
        if isinstance(error, ModelInputError):
            log.warning(
                "model %s: answered 400 to a request whose inputs made the dense model fail: %s",
                self.name,
                error.message,
                exc_info=error,
            )

    def _run_locked(self, merged: Batch) -> tuple[np.ndarray, Any]:
        with self._run_lock:
            return self._run(merged)

    def _run(self, merged: Batch) -> tuple[np.ndarray, Any]:
        """One lookup + one model call for a merged batch: (predictions float32 [n, 1], the
        (version, unknown IDs, fallback IDs) they come with)."""
        model = self._model  # the version that answers this whole merged batch
        output = model.infer(merged)
        self.metrics.lookup_latency.observe(output.lookup_seconds)
        self.metrics.compute_latency.observe(output.compute_seconds)
        ids = merged.num_ids
        self.metrics.ids.inc(ids)
        self.metrics.unknown_ids.inc(output.unknown_ids)
        self.metrics.fallback_ids.inc(output.fallback_ids)
        # One check for the merged batch; only requests of a batch that failed it look at
        # their own rows (_answer).
        all_finite = bool(np.isfinite(output.predictions).all())
        context = (
            model.version,
            output.fallback_ids,
            output.unknown_ids,
            ids,
            all_finite,
            output.unknown_per_sample,
        )
        return output.predictions, context

    def predict(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        *,
        protocol: str,
        timeout: float | None = None,
        on_cancel: CancelHook | None = None,
    ) -> Prediction:
        """Predictions for named input tensors (IDs int/uint [batch] or jagged with
        ``<name>.lengths``; dense float32 [batch, ...]) from any thread: validated, merged with
        concurrent requests by the dispatcher thread, answered as float32 [batch, 1]. Waits
        ``timeout`` seconds at most (default: the server's).

        ``on_cancel`` (:data:`CancelHook`, gRPC's ``context.add_callback``) tells the core when
        the caller is gone: a request still queued then is dropped before its merged batch
        runs, and one not answered yet is counted as ``cancelled`` and raises
        :class:`concurrent.futures.CancelledError` (nobody is left to answer)."""
        return self._predict(
            name,
            version,
            self._tensor_builder(inputs),
            protocol=protocol,
            timeout=timeout,
            on_cancel=on_cancel,
        )

    def _tensor_builder(self, inputs: Mapping[str, np.ndarray]) -> Callable[[LoadedModel], Batch]:
        """Validates named request tensors against a model's signature into a Batch."""

        def build(model: LoadedModel) -> Batch:
            return tensors.tensors_to_batch(
                model.signature, inputs, max_batch_size=self.max_request_batch_size
            )

        return build

    def predict_instances(
        self,
        name: str,
        instances: Sequence[Mapping[str, Any]],
        *,
        protocol: str,
        timeout: float | None = None,
        on_cancel: CancelHook | None = None,
    ) -> Prediction:
        """Predictions for friendly rows (``on_cancel`` as in :meth:`predict`)."""

        def build(model: LoadedModel) -> Batch:
            if self._preprocessor is None:
                inputs = instance_inputs.instances_to_inputs(model.signature, instances)
                return tensors.tensors_to_batch(
                    model.signature, inputs, max_batch_size=self.max_request_batch_size
                )
            if len(instances) > self.max_request_batch_size:
                # Checked before the preprocessor runs: it holds the GIL for every row.
                raise InvalidArgumentError(
                    f"batch size {len(instances)} exceeds this server's max batch size "
                    f"{self.max_request_batch_size}"
                )
            try:
                batch = self._preprocessor(list(instances))
            except RecserveError:
                raise
            except PREPROCESSOR_INPUT_ERRORS as error:
                # The client's rows, most likely (a 400, as recserve eval counts them bad
                # rows); but the operator's own preprocessor may be at fault (a TypeError in
                # its code), so its traceback is logged as a
                # warning, once per origin per interval: a client looping on bad rows cannot
                # flood the log.
                left_out = self._preprocessor_errors.admit(error)
                if left_out is not None:
                    log.warning(
                        "the preprocessor refused %d instance(s): %s (a client's bad rows or "
                        "the preprocessor's bug; logged once per %g s per origin, %d more from "
                        "this origin since)",
                        len(instances),
                        summary_with_origin(error),
                        self._preprocessor_errors.interval,
                        left_out,
                        exc_info=True,
                    )
                raise InvalidArgumentError(
                    f"instances could not be preprocessed: {_refusal(error)}"
                ) from None
            if not isinstance(batch, Batch):
                # The preprocessor's bug, not the client's: a 500, its message in the log.
                raise TypeError(f"the preprocessor returned a {type(batch).__name__}, not a Batch")
            if batch.batch_size > self.max_request_batch_size:
                # A property of the request, not of the server's load: 400, never retried.
                raise InvalidArgumentError(
                    f"batch size {batch.batch_size} exceeds this server's max batch size "
                    f"{self.max_request_batch_size}"
                )
            if batch.batch_size != len(instances):
                # Answers are matched to instances by position: a row dropped or added
                # would give every later instance another one's prediction, with a 200.
                # The preprocessor's bug, not the client's: a 500, its message in the log.
                raise ValueError(
                    f"the preprocessor returned a batch of {batch.batch_size} sample(s) for "
                    f"{len(instances)} instance(s); it must give one sample per instance, in "
                    "order"
                )
            model.signature.check(batch)
            tensors.require_finite_features(batch)
            return batch

        return self._predict(
            name, None, build, protocol=protocol, timeout=timeout, on_cancel=on_cancel
        )

    def _prepare(
        self,
        name: str,
        version: str | None,
        build: Callable[[LoadedModel], Batch],
        timeout: float | None,
    ) -> tuple[Batch, float]:
        """Validate and build the batch: (batch, seconds it may wait)."""
        if not self._accepting:
            raise UnavailableError("the server is not ready (shutting down)")
        model = self._check_name(name, version)
        batch = build(model)
        wait = timeout if timeout is not None else self.default_timeout
        # gRPC reports "no deadline" as ~1e10 s left, and clients may send huge timeouts:
        # clamp, or Future.result / lock waits overflow (OverflowError -> a 500).
        return batch, min(wait, MAX_WAIT_SECONDS)

    def _begin(
        self,
        name: str,
        version: str | None,
        build: Callable[[LoadedModel], Batch],
        timeout: float | None,
    ) -> tuple[Batch, Future, float, float]:
        """Validate, build the batch, queue it: (batch, future of BatchOutcome, wait s, its
        monotonic deadline)."""
        batch, wait = self._prepare(name, version, build, timeout)
        deadline = time.monotonic() + wait
        return batch, self._batcher.submit(batch, deadline=deadline), wait, deadline

    def _loop_batcher(self) -> LoopBatcher:
        loop = asyncio.get_running_loop()
        batcher = self._loop_batchers.get(loop)
        if batcher is None:
            max_batch_size, max_queue_delay, max_queue_size = self._batch_limits
            batcher = LoopBatcher(
                self._run,
                max_batch_size=max_batch_size,
                max_queue_delay=max_queue_delay,
                max_queue_size=max_queue_size,
                run_lock=self._run_lock,
                on_batch=self._observe_batch,
                on_drop=self._count_drop,
                on_split=self.metrics.split_batches.inc,
            )
            self._loop_batchers[loop] = batcher
        return batcher

    def _answer(self, batch: Batch, result: BatchOutcome, version: str | None = None) -> Prediction:
        served_version, merged_fallback, merged_unknown, merged_ids, all_finite, per_sample = (
            result.context
        )
        if version and served_version != version:
            # The request named a version (.../versions/V/infer) and a reload swapped in
            # another while it waited for its batch: V no longer serves, and another
            # version's answer is not what was asked for.
            raise NotFoundError(
                f"model {self.name!r} version {version!r} was replaced by version "
                f"{served_version!r} while this request waited; the served version is "
                f"{served_version!r}"
            )
        self.metrics.queue_latency.observe(result.queue_seconds)
        if not all_finite:
            tensors.require_finite_predictions(result.predictions)
        own_ids = batch.num_ids
        return Prediction(
            outputs={tensor_specs.OUTPUT_NAME: result.predictions},
            model_name=self.name,
            model_version=served_version,
            # Every ID of the merged batch fell back, so all of ours did.
            fallback_ids=own_ids if merged_fallback else 0,
            unknown_ids=_own_unknown(
                merged_unknown, per_sample, result.offset, batch.batch_size, own_ids, merged_ids
            ),
        )

    def _create_series(self, version: str) -> None:
        """Make ``version`` live and its common request series (:data:`PROTOCOLS` x
        :data:`COMMON_OUTCOMES`, served model name) exist at 0: a series born at 1 is
        invisible to ``increase()`` / ``rate()``. The caller holds ``_series_lock``."""
        self._live_versions.add(version)
        for protocol in PROTOCOLS:
            for outcome in COMMON_OUTCOMES:
                key = (protocol, self.name, version, outcome)
                if key not in self._request_counters:
                    self._request_counters[key] = self.metrics.requests.labels(*key)

    def _new_counter(self, key: tuple[str, str, str, str]) -> Any:
        """The counter child of ``key``, created and cached; None when its version is no
        longer live (the sample is dropped rather than recreate a forgotten series)."""
        with self._series_lock:
            counter = self._request_counters.get(key)
            if counter is None:
                if key[2] not in self._live_versions:
                    return None
                counter = self._request_counters[key] = self.metrics.requests.labels(*key)
            return counter

    def _count(self, protocol: str, name: str, version: str, outcome: str) -> None:
        # The name comes from the client: only the served one becomes a label value, so
        # requests to made-up names cannot grow the metrics without bound.
        key = (protocol, name if name == self.name else UNKNOWN_MODEL_LABEL, version, outcome)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._new_counter(key)
            if counter is None:
                return
        # A child that _forget_version removed meanwhile is counted but no longer exported.
        counter.inc()

    def record_rejected(self, protocol: str, name: str, error: BaseException) -> None:
        """Count a request that its front end refused before it reached the core (a body
        that cannot be read or decoded, too large, bad tensors): outcome is the error's class
        name (``error`` for an unexpected one; ``cancelled`` for a CancelledError, a client
        gone before its body was in), version the served one. It is not timed
        (``recserve_request_latency_seconds`` starts when a request reaches the core)."""
        if isinstance(error, CancelledError):  # the client left before sending it all
            outcome = "cancelled"
        else:
            outcome = type(error).__name__ if isinstance(error, RecserveError) else "error"
        self._count(protocol, name, self._model.version, outcome)

    def _record(self, protocol: str, name: str, version: str, outcome: str, started: float) -> None:
        # _count, inline: this runs for every request.
        key = (protocol, name if name == self.name else UNKNOWN_MODEL_LABEL, version, outcome)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._new_counter(key)
        if counter is not None:
            counter.inc()
        latency = self._request_latencies.get(protocol)
        if latency is None:
            latency = self._request_latencies[protocol] = self.metrics.request_latency.labels(
                protocol
            )
        latency.observe(time.perf_counter() - started)

    @contextlib.contextmanager
    def _recorded(self, protocol: str, name: str) -> Iterator[list[Prediction]]:
        """Count and time one request; the body appends its Prediction on success."""
        started = time.perf_counter()
        answered: list[Prediction] = []
        outcome = "error"
        try:
            yield answered
            outcome = "ok"
        except RecserveError as error:
            outcome = type(error).__name__
            self._log_input_error(error)
            raise
        except CancelledError:  # its caller is gone (a gRPC call cancelled by its client)
            outcome = "cancelled"
            raise
        finally:
            version = answered[0].model_version if answered else self._model.version
            self._record(protocol, name, version, outcome, started)

    def _predict(
        self,
        name: str,
        version: str | None,
        build: Callable[[LoadedModel], Batch],
        *,
        protocol: str,
        timeout: float | None,
        on_cancel: CancelHook | None = None,
    ) -> Prediction:
        with self._recorded(protocol, name) as answered:
            batch, future, wait, deadline = self._begin(name, version, build, timeout)
            gone: list[float] = []
            if on_cancel is not None:

                def give_up() -> None:
                    # Runs when the call ends: after the answer (the future is done and this
                    # does nothing) or when its client cancelled it or its deadline passed.
                    if not future.done():
                        gone.append(time.monotonic())
                        future.cancel()  # skipped by the dispatcher if not running yet

                if not on_cancel(give_up):
                    give_up()  # already over
            try:
                result: BatchOutcome = future.result(timeout=wait)
            except TimeoutError:
                future.cancel()
                raise _deadline(wait) from None
            except CancelledError:
                if not gone:
                    raise
            if gone:
                # The call ended before its answer (which, if computed, nobody takes): at its
                # deadline, or cancelled by its client (counted as "cancelled").
                if gone[0] >= deadline - _DEADLINE_SLACK_SECONDS:
                    raise _deadline(wait)
                raise CancelledError
            answered.append(self._answer(batch, result, version))
        return answered[0]

    async def predict_async(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        *,
        protocol: str,
        timeout: float | None = None,
    ) -> Prediction:
        """:meth:`predict` for an event loop: validation runs on the caller's loop (cheap for
        small requests) and, with an in-process embedding tier, the request is batched with
        the others of that loop and run there (:class:`LoopBatcher`), with no thread hand-off;
        with a remote tier it goes to the dispatcher thread. Past its deadline while queued,
        it is answered DeadlineExceededError then; a cancelled caller (the client went away)
        frees its place in the queue at once."""
        # What _recorded does, inline: a generator context manager per request costs ~2 us.
        started = time.perf_counter()
        outcome = "error"
        served: str | None = None
        try:
            batch, wait = self._prepare(name, version, self._tensor_builder(inputs), timeout)
            deadline = time.monotonic() + wait
            if isinstance(self._model.tier, InProcessEmbeddingTier):
                result = await self._loop_batcher().submit(batch, deadline=deadline)
            else:
                # Lookups cross the network (up to the lookup timeout): run them on the
                # dispatcher thread, or a slow shard would stall this loop and every request
                # and health probe on it. Waiting is bounded as in predict().
                queued = asyncio.wrap_future(self._batcher.submit(batch, deadline=deadline))
                try:
                    result = await asyncio.wait_for(queued, timeout=wait)
                except TimeoutError:
                    raise _deadline(wait) from None
            prediction = self._answer(batch, result, version)
            served = prediction.model_version
            outcome = "ok"
            return prediction
        except RecserveError as error:
            outcome = type(error).__name__
            self._log_input_error(error)
            raise
        except asyncio.CancelledError:  # the client went away (serving.http_protocol)
            outcome = "cancelled"
            raise
        finally:
            self._record(protocol, name, served or self._model.version, outcome, started)

    # ------------------------------------------------------------------ hot reload
    def reload(self, checkpoint_dir: str | None = None) -> dict[str, Any]:
        """Load a checkpoint next to the served one, check and warm it, then swap.

        In-flight requests finish on the old version; a failed load keeps the old version
        serving, is counted, and raised to the caller (who reports it).
        """
        if self._loader is None:
            raise UnavailableError("this server was started without a checkpoint loader")
        with self._reload_lock:
            if self._closed:
                # Started after close() (the watcher's poll that was under way when the stop
                # came): it would load a model nothing serves, after the stop's
                # wait_for_reload, while the interpreter shuts down (SIGABRT in torch).
                raise UnavailableError("the server is stopping: it loads no new version")
            old = self._model
            try:
                new = self._load_for_reload(checkpoint_dir)
                # The inputs only: requests are validated against them (and a batch built
                # for one version may run on the other), while label names are training's
                # business, and a model retrained with its label renamed serves the same.
                served = (old.signature.id_features, old.signature.non_id_features)
                if (new.signature.id_features, new.signature.non_id_features) != served:
                    new.close()
                    raise CheckpointError(
                        "the new checkpoint's feature signature differs from the served one; "
                        "restart the server to change the model's inputs"
                    )
            except RecserveError as error:
                self.metrics.reloads.labels("failed").inc()
                self.last_reload_error = error.message
                log.error("reload failed, still serving %s: %s", old.version, error.message)
                raise
            with self._series_lock:  # one step for _forget_version of a reload before
                stopping = self._closed
                if not stopping:
                    self._create_series(new.version)  # at 0 before its first request
                    self._model = new
            if stopping:  # close() ran while it loaded: nothing serves it any more
                new.close()
                raise UnavailableError(
                    f"the server is stopping: version {new.version} was loaded but is not served"
                )
            # The new model lives as long as the old one did: keep it out of collections too
            # (no collection first: that would stall every request for ~100 ms).
            freeze_long_lived_objects(collect=False)
            self.metrics.set_model(self.name, new.version)
            self.metrics.reloads.labels("ok").inc()
            self.last_reload_error = None
            log.info("now serving %s version %s (was %s)", self.name, new.version, old.version)
        previous = old.version
        # Every model call runs under _run_lock and reads self._model as it starts: once the
        # merged batch running at the swap (if any) is done, nothing uses ``old``. Closed
        # now, not after a fixed delay: reloads in a burst never keep several tables alive.
        with self._run_lock:
            pass
        old.close()
        del old
        if previous != new.version:
            self._forget_version(previous)
        release_memory()
        return {"model": self.name, "version": new.version, "previous_version": previous}

    def _forget_version(self, version: str) -> None:
        """Drop the request counters of a version no longer served: one series per version
        and outcome would otherwise pile up over a server's life of reloads. A request of
        that version counted later is dropped, never recreating them (_new_counter)."""
        with self._series_lock:
            if version == self._model.version:  # served again (a burst of reloads)
                return
            self._live_versions.discard(version)
            for key in list(self._request_counters):
                if key[2] == version:
                    self._request_counters.pop(key, None)
                    self.metrics.forget(self.metrics.requests, key)

    def _load_for_reload(self, checkpoint_dir: str | None) -> LoadedModel:
        """The loader's model, or CheckpointError: a checkpoint that passes verification can
        still fail to load or warm up (a dense model that raises on the example batch), and
        that is the checkpoint's fault, not the server's."""
        assert self._loader is not None
        try:
            return self._loader(checkpoint_dir)
        except RecserveError:
            raise
        except Exception as error:
            log.exception("loading the new checkpoint failed")
            raise CheckpointError(
                f"the new checkpoint cannot be served: {error_summary(error)}"
            ) from error


def release_memory() -> None:
    """After a replaced model is dropped: free the reference cycles it left (its objects were
    frozen out of the collector, embedding_store.gc_tuning, so only this collection, one of
    ~100 ms, frees them), then hand the freed pages back to the system (glibc keeps them,
    and a server's RSS would stay at its peak of two tables)."""
    collect_released_objects()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
