"""Prometheus metrics of a parameter server (names prefixed ``recserve_ps_``).

:class:`ParameterServerMetrics` holds the RPC latency and error metrics in their own registry
and reads the shard's counters (:meth:`EmbeddingShard.stats`) at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedding_store.rpc_metrics import TierTlsReloads, rpc_metrics
from embedding_store.shard import EmbeddingShard


class _ShardCollector(Collector):
    """Shard counters read from :meth:`EmbeddingShard.stats` at scrape time (exact, no drift)."""

    def __init__(self, shard: EmbeddingShard, serving: Callable[[], bool], labels: dict) -> None:
        self._shard = shard
        self._serving = serving
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._shard.stats()
        names, values = list(self._labels), list(self._labels.values())

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"recserve_ps_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"recserve_ps_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def by_mode(name: str, doc: str, train: int, eval_: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"recserve_ps_{name}", doc, labels=[*names, "mode"])
            family.add_metric([*values, "train"], train)
            family.add_metric([*values, "eval"], eval_)
            return family

        yield by_mode(
            "lookups",
            "Lookup calls by mode: train (may insert) or eval (eval and inference, never inserts).",
            stats.lookups - stats.eval_lookups,
            stats.eval_lookups,
        )
        yield by_mode(
            "ids_looked_up",
            "IDs looked up (per occurrence) by mode: train or eval (eval and inference).",
            stats.ids_looked_up - stats.eval_ids_looked_up,
            stats.eval_ids_looked_up,
        )
        yield counter(
            "misses",
            "Unknown IDs of eval/infer lookups, answered with zeros (miss ratio: "
            'recserve_ps_misses_total / recserve_ps_ids_looked_up_total{mode="eval"}).',
            stats.misses,
        )
        yield counter(
            "inserts",
            "Rows created by train lookups and row imports (not checkpoint loads: "
            "recserve_ps_rows_loaded_total).",
            stats.inserts,
        )
        yield counter(
            "rows_loaded", "Rows put in whole from embedding checkpoints.", stats.rows_loaded
        )
        yield counter("evictions", "Rows evicted by the LRU policy.", stats.evictions)
        yield counter(
            "rejected_admissions",
            "Unknown IDs of train lookups not admitted, answered with zeros (rejection ratio: "
            "recserve_ps_rejected_admissions_total / "
            'recserve_ps_ids_looked_up_total{mode="train"}).',
            stats.rejected_admissions,
        )
        yield counter("rows_updated", "Rows updated by the optimizer.", stats.updates)
        yield counter(
            "skipped_updates", "Update IDs the shard no longer held.", stats.skipped_updates
        )
        yield counter(
            "stale_updates",
            "Update rows refused: computed against rows that a load or clear of the shard "
            "replaced since their lookup (through another worker).",
            stats.stale_updates,
        )
        yield gauge("rows", "Rows held, all dims together.", stats.rows)
        yield gauge("capacity", "Row capacity of the shard.", stats.capacity)
        yield gauge(
            "serving", "1 when the shard is loaded/configured and serving.", self._serving()
        )


class ParameterServerMetrics:
    """The Prometheus metrics of one parameter server, in their own registry."""

    def __init__(self, replica_index: int, replica_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"replica": str(replica_index), "replicas": str(replica_size)}
        self.latency, self.errors = rpc_metrics(self.registry, "recserve_ps", "ParameterServer")
        self.registry.register(TierTlsReloads("recserve_ps"))

    def watch_shard(self, shard: EmbeddingShard, serving: Callable[[], bool]) -> None:
        self.registry.register(_ShardCollector(shard, serving, self.labels))
