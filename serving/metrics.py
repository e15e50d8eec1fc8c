"""Prometheus metrics of the prediction server (one registry per server, promtool-valid)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Histogram buckets (seconds) of the server's own latencies (request, queue, lookup, compute):
#: a batch-1 request is ~100 us and a merged batch's model call tens of us, so the buckets
#: start at 25 us (the RPC buckets of embedding_store.rpc_metrics start at 0.5 ms, where
#: nearly every compute sample fell into the first bucket).
SERVING_LATENCY_BUCKETS = (
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

#: The protocols whose request series exist from start-up (and from each reload) at 0.
PROTOCOLS = ("http", "grpc")
#: The outcomes whose request series exist at 0 for the served version: what most requests
#: end as (success, the usual 4xx / 5xx classes, a client that went away, an unexpected 500).
#: A rarer outcome's series appears with its first request.
COMMON_OUTCOMES = (
    "ok",
    "InvalidArgumentError",
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
            "Requests queued or being computed.",
            registry=r,
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
        self.model_info = Gauge(
            "recserve_model_info",
            "The served model version (value 1).",
            ["model", "version"],
            registry=r,
        )
        self.checkpoint_age = Gauge(
            "recserve_checkpoint_age_seconds",
            "Seconds since the served checkpoint was written.",
            registry=r,
        )
        self.ready = Gauge("recserve_ready", "1 when the server is ready.", registry=r)
        self.tier_serving = Gauge(
            "recserve_embedding_tier_serving",
            "1 when every embedding shard answered and served at the last check (every 2 s).",
            registry=r,
        )
        self.tier_version_mismatch = Gauge(
            "recserve_embedding_tier_version_mismatch",
            "Embedding shards whose rows come from another embedding checkpoint than the "
            "served model's, at the last check (0 when they all match or do not say).",
            registry=r,
        )

    def track_pending(self, pending: Callable[[], int]) -> None:
        self.pending.set_function(lambda: float(pending()))

    def track_checkpoint(self, created_unix: Callable[[], float]) -> None:
        self.checkpoint_age.set_function(lambda: max(0.0, time.time() - created_unix()))

    def set_model(self, model: str, version: str) -> None:
        self.model_info.clear()
        self.model_info.labels(model=model, version=version).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
