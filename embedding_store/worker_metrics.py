"""Prometheus metrics of an embedding worker (names prefixed ``recserve_worker_``).

:class:`EmbeddingWorkerMetrics` holds the RPC latency and error metrics in their own registry
and reads the tier's counters (:meth:`RemoteShardTier.stats`) at scrape time;
:func:`start_metrics_server` serves them over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedding_store.errors import (
    UnavailableError,
)
from embedding_store.grpc_common import (
    format_address,
)
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.rpc_metrics import TierTlsReloads, rpc_metrics


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
            "ID occurrences answered with zeros: unknown to eval/infer lookups, or not admitted "
            "by train lookups (an ID repeated in a lookup counts each time, although its shard "
            "is asked for it once).",
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
        self.registry.register(TierTlsReloads("recserve_worker"))

    def watch_tier(self, tier: RemoteShardTier) -> None:
        self.registry.register(_WorkerCollector(tier))


def start_metrics_server(metrics: EmbeddingWorkerMetrics, host: str, port: int) -> WSGIServer:
    """Serve ``metrics.registry`` on http://HOST:PORT/metrics (a thread); returns the server."""
    try:
        httpd, _thread = start_http_server(port, addr=host.strip("[]"), registry=metrics.registry)
    except OSError as error:
        raise UnavailableError(
            f"cannot serve metrics on {format_address(host, port)}: {error}"
        ) from None
    return httpd


__all__ = ["EmbeddingWorkerMetrics", "start_metrics_server"]
