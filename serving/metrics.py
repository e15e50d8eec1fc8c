"""Prometheus metrics of the prediction server (one registry per server, promtool-valid).

The processes of a ``recserve serve --workers N`` server share their ports, so a scrape
reaches any one of them: they keep their metrics in prometheus_client's multiprocess mode
(:data:`MULTIPROCESS_VARIABLE`, a fresh directory the parent gives its processes), and each
answers ``/metrics`` with every process's counters and histograms summed. Gauges combine
as their help says: pending requests add up, ready and tier serving are their minimum, the
checkpoint age and version mismatches their maximum. The series of a version that no process
serves any more are left out of the answer (:class:`_ServedVersionsOnly`), as one process
removes them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from embedding_store.rpc_metrics import LATENCY_BUCKETS
from serving.batcher import DROP_REASONS

#: Set (by ``serve --workers``) to the directory where each process keeps its metrics.
MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
#: How often a process of a multi-process server refreshes its computed gauges.
GAUGE_REFRESH_SECONDS = 1.0

#: Histogram buckets (seconds) of the server's own latencies (request, queue, lookup, compute):
#: a batch-1 request is ~100 us and a merged batch's model call tens of us, so the buckets
#: start at 25 us, as the RPC buckets of embedding_store.rpc_metrics do, and end at 10 s.
SERVING_LATENCY_BUCKETS = tuple(bucket for bucket in LATENCY_BUCKETS if bucket <= 10.0)

#: The protocols whose request series exist from start-up (and from each reload) at 0.
PROTOCOLS = ("http", "grpc")
#: The outcomes whose request series exist at 0 for the served version: what most requests
#: end as (success, the usual 4xx / 5xx classes, a request's inputs the model refused, a client
#: that went away, an unexpected 500).
#: A rarer outcome's series appears with its first request.
COMMON_OUTCOMES = (
    "ok",
    "InvalidArgumentError",
    "ModelInputError",
    "CapacityError",
    "UnavailableError",
    "DeadlineExceededError",
    "cancelled",
    "error",
)
#: The outcomes of ``recserve_reloads_total``, both present from start-up.
RELOAD_OUTCOMES = ("ok", "failed")

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    """Every metric the server exports; front ends and the core record into it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: The shared directory of a multi-process server, or None (one process).
        self.multiprocess_directory = os.environ.get(MULTIPROCESS_VARIABLE) or None
        self._computed: list[tuple[Gauge, Callable[[], float]]] = []
        self._served: tuple[str, str] | None = None
        self.requests = Counter(
            "recserve_requests",
            "Prediction requests by protocol, model, version and outcome.",
            ["protocol", "model", "version", "outcome"],
            registry=r,
        )
        self.request_latency = Histogram(
            "recserve_request_latency_seconds",
            "Time from a request reaching the core to its answer (requests refused before, "
            "e.g. undecodable, are counted in recserve_requests_total only).",
            ["protocol"],
            buckets=SERVING_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_latency = Histogram(
            "recserve_queue_latency_seconds",
            "Time a request waited for the dynamic batcher.",
            buckets=SERVING_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_latency = Histogram(
            "recserve_compute_latency_seconds",
            "Dense model time per merged batch.",
            buckets=SERVING_LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_latency = Histogram(
            "recserve_embedding_lookup_latency_seconds",
            "Embedding lookup time per merged batch.",
            buckets=SERVING_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "recserve_batch_size",
            "Samples per merged batch sent to the model.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.pending = Gauge(
            "recserve_pending_requests",
            "Requests queued or being computed (all processes together).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ids = Counter(
            "recserve_ids_looked_up", "IDs looked up in the embedding tier.", registry=r
        )
        self.unknown_ids = Counter(
            "recserve_unknown_ids",
            "IDs the embedding tier did not hold (answered with the slot default).",
            registry=r,
        )
        self.fallback_ids = Counter(
            "recserve_fallback_ids",
            "IDs answered with default vectors because the lookup failed or timed out.",
            registry=r,
        )
        self.reloads = Counter(
            "recserve_reloads", "Checkpoint reloads by outcome.", ["outcome"], registry=r
        )
        for outcome in RELOAD_OUTCOMES:  # at 0: the first failed reload shows in increase()
            self.reloads.labels(outcome)
        # Labelled at 0 by a server with TLS (serving.server), like reloads above.
        self.tls_reloads = Counter(
            "recserve_tls_reloads",
            "Reloads of changed --tls-* files by outcome (failed: the previous certificate "
            "stays in use); each process of a --workers server reloads, and counts, its own.",
            ["outcome"],
            registry=r,
        )
        # Labelled at 0 by the server (serving.server), like reloads above.
        self.http_refused = Counter(
            "recserve_http_refused",
            "HTTP connections refused over --max-connections (reason connections) and "
            "requests refused over --max-body-bytes-in-flight (reason body_bytes), with 503.",
            ["reason"],
            registry=r,
        )
        self.dropped_requests = Counter(
            "recserve_dropped_requests",
            "Requests dropped from a batcher's queue before their merged batch ran, never "
            "computed, by reason: cancelled (the client went away: HTTP connection closed, "
            "gRPC call cancelled) or deadline (their deadline passed while they were queued).",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:  # at 0: the first drop shows in increase()
            self.dropped_requests.labels(reason)
        self.split_batches = Counter(
            "recserve_split_batches",
            "Merged batches of several requests that failed with an error one request's "
            "inputs can cause (the model raised, or refused an input) and were run again "
            "request by request, so that only the requests at fault failed.",
            registry=r,
        )
        self.model_info = Gauge(
            "recserve_model_info",
            "The served model version (value 1).",
            ["model", "version"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.checkpoint_age = Gauge(
            "recserve_checkpoint_age_seconds",
            "Seconds since the served checkpoint was written (the oldest of all processes).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "recserve_ready", "1 when the server (every process) is ready.", registry=r,
            multiprocess_mode="livemin",
        )  # fmt: skip
        self.tier_serving = Gauge(
            "recserve_embedding_tier_serving",
            "1 when every embedding shard answered and served at the last check (every 2 s).",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.tier_version_mismatch = Gauge(
            "recserve_embedding_tier_version_mismatch",
            "Embedding shards whose rows come from another embedding checkpoint than the "
            "served model's, at the last check (0 when they all match or do not say).",
            registry=r,
            multiprocess_mode="livemax",
        )
        if self.multiprocess_directory is not None:
            threading.Thread(
                target=self._refresh_forever, name="metrics-refresh", daemon=True
            ).start()

    def track(self, gauge: Gauge, value: Callable[[], float]) -> None:
        """``gauge`` reads ``value()``: at each scrape, or (several processes, where a scrape
        reads the values the processes stored) every :data:`GAUGE_REFRESH_SECONDS`."""
        if self.multiprocess_directory is None:
            gauge.set_function(value)
        else:
            self._computed.append((gauge, value))
            gauge.set(float(value()))

    def track_pending(self, pending: Callable[[], int]) -> None:
        self.track(self.pending, lambda: float(pending()))

    def track_checkpoint(self, created_unix: Callable[[], float]) -> None:
        self.track(self.checkpoint_age, lambda: max(0.0, time.time() - created_unix()))

    def set_model(self, model: str, version: str) -> None:
        if self.multiprocess_directory is None:
            self.model_info.clear()
        elif self._served is not None:  # stored values cannot be removed: 0 says "not now",
            # and the exposition drops such a version's series (_ServedVersionsOnly)
            self.model_info.labels(*self._served).set(0)
        self.model_info.labels(model=model, version=version).set(1)
        self._served = (model, version)

    def forget(self, counter: Counter, labels: tuple[str, ...]) -> None:
        """Remove one labelled series (one process; several keep what they stored)."""
        if self.multiprocess_directory is None:
            with contextlib.suppress(KeyError):
                counter.remove(*labels)

    def exposition(self) -> bytes:
        if self.multiprocess_directory is None:
            return generate_latest(self.registry)
        self._refresh()
        registry = CollectorRegistry()
        registry.register(_ServedVersionsOnly(self.multiprocess_directory))
        return generate_latest(registry)

    def _refresh(self) -> None:
        for gauge, value in self._computed:
            gauge.set(float(value()))

    def _refresh_forever(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_SECONDS)
            try:
                self._refresh()
            except Exception:  # a value read mid-reload: the next round gets it
                continue


class _ServedVersionsOnly(Collector):
    """Every process's metrics (prometheus_client's multiprocess files in ``path``), less
    the series of versions that no process serves any more.

    A process cannot remove what it stored in its file, so each reload would otherwise leave
    its replaced version's ``recserve_model_info`` (at 0) and its 14+ request series in every
    scrape for the server's life: one more set per reload, without bound. They are dropped
    here, as one process removes them (:meth:`ServingMetrics.forget`): a version is served
    while ``recserve_model_info`` reads 1 for it (the maximum over the live processes).
    """

    def __init__(self, path: str) -> None:
        from prometheus_client import multiprocess

        self._collector = multiprocess.MultiProcessCollector(None, path=path)

    def collect(self) -> Iterator[Metric]:
        families = list(self._collector.collect())
        served = {
            sample.labels.get("version")
            for family in families
            if family.name == _MODEL_INFO
            for sample in family.samples
            if sample.value > 0
        }
        for family in families:
            if family.name == _MODEL_INFO:
                family.samples = [sample for sample in family.samples if sample.value > 0]
            elif family.name == _REQUESTS:
                family.samples = [
                    sample for sample in family.samples if sample.labels.get("version") in served
                ]
            yield family


_MODEL_INFO = "recserve_model_info"
_REQUESTS = "recserve_requests"
