"""Latency and error metrics of gRPC servicer methods, shared by the parameter server and the
embedding worker.

A servicer whose ``self.metrics`` has ``latency`` (a Histogram labelled by method) and
``errors`` (a Counter labelled by method and gRPC status code name) decorates its methods
with :func:`observed` (unary and client-streaming) or :func:`observed_stream`
(server-streaming: the whole stream is timed).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from embedding_store.errors import RecserveError, grpc_code_name_of

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message

#: Histogram buckets (seconds) of RPC latencies: from a shard's Lookup of a serving batch
#: (~50-300 us server side: with a first bucket at 0.5 ms every one fell into it, and its
#: quantiles read as that bucket's interpolation) up to long dumps. The prediction server's
#: own latencies use those up to 10 s (serving.metrics).
LATENCY_BUCKETS = (
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
    30.0,
    120.0,
)


#: Status codes whose ``rpc_errors`` series exist at 0 for every method from the start, so
#: that the first failure of each shows in ``increase()`` / ``rate()`` (a series born at 1
#: does not). Rarer codes appear with their first failure.
PRECREATED_ERROR_CODES = (
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
)


def service_methods(service: str) -> tuple[str, ...]:
    """The methods of the embedding tier's gRPC service ``service`` (``"ParameterServer"``,
    ``"EmbeddingWorker"``), as embedding_tier.proto declares them; () for another name."""
    from embedding_store.proto import embedding_tier_pb2

    descriptor = embedding_tier_pb2.DESCRIPTOR.services_by_name.get(service)
    return () if descriptor is None else tuple(method.name for method in descriptor.methods)


def rpc_metrics(
    registry: CollectorRegistry,
    prefix: str,
    service: str,
    latency_note: str = "server side",
    methods: Iterable[str] | None = None,
) -> tuple[Histogram, Counter]:
    """The two metrics :func:`observed` records: ``{prefix}_rpc_latency_seconds`` (Histogram
    by method) and ``{prefix}_rpc_errors`` (Counter by method and status code name).

    The error series of ``methods`` (default: the methods of the gRPC service ``service``,
    :func:`service_methods`) and :data:`PRECREATED_ERROR_CODES` start at 0."""
    latency = Histogram(
        f"{prefix}_rpc_latency_seconds",
        f"Latency of {service} RPCs by method ({latency_note}).",
        ["method"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    errors = Counter(
        f"{prefix}_rpc_errors",
        f"Failed {service} RPCs by method and status code.",
        ["method", "code"],
        registry=registry,
    )
    for method in service_methods(service) if methods is None else methods:
        for code in PRECREATED_ERROR_CODES:
            errors.labels(method, code)
    return latency, errors


def unauthenticated_counter(errors: Counter) -> Callable[[str], None]:
    """What counts, in ``errors`` (an ``rpc_errors`` counter of :func:`rpc_metrics`), a call
    the tier token check refused: ``on_refused`` of
    :func:`embedding_store.grpc_common.server_interceptors`."""

    def count(method: str) -> None:
        errors.labels(method, "UNAUTHENTICATED").inc()

    return count


class TierTlsReloads(Collector):
    """``{prefix}_tls_reloads_total{outcome}``: reloads of the tier's renewed TLS files
    (RECSERVE_TIER_TLS_*) by this process, ok or failed (the previous files stay in use);
    read at scrape time. Nothing under plaintext."""

    def __init__(self, prefix: str) -> None:
        self._name = f"{prefix}_tls_reloads"

    def collect(self) -> Iterator[Metric]:
        from embedding_store.grpc_common import tier_tls_files

        try:
            files = tier_tls_files()
        except RecserveError:  # bad variables: the process said so at start
            return
        if files is None:
            return
        family = CounterMetricFamily(
            self._name,
            "Reloads of the changed RECSERVE_TIER_TLS_* files by outcome (failed: the "
            "previous certificate stays in use).",
            labels=["outcome"],
        )
        for outcome, count in files.counts.items():
            family.add_metric([outcome], count)
        yield family


class _RpcMetrics(Protocol):
    """What :func:`observed` records into: the two metrics made by :func:`rpc_metrics`."""

    @property
    def latency(self) -> Histogram: ...

    @property
    def errors(self) -> Counter: ...


class _ObservedServicer(Protocol):
    """A servicer whose methods are decorated with :func:`observed` / :func:`observed_stream`."""

    @property
    def metrics(self) -> _RpcMetrics: ...


F = TypeVar("F", bound=Callable[..., Any])


def _count_error(servicer: _ObservedServicer, method: str, error: BaseException) -> None:
    servicer.metrics.errors.labels(method, grpc_code_name_of(error)).inc()


def observed(method: F) -> F:
    """Record latency and failures of a unary (or client-streaming) RPC method."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(
        self: _ObservedServicer, request: Message, context: grpc.ServicerContext
    ) -> Message:
        start = time.perf_counter()
        try:
            return method(self, request, context)
        except Exception as error:
            _count_error(self, name, error)
            raise
        finally:
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]


def observed_stream(method: F) -> F:
    """Like :func:`observed` for server-streaming methods (the whole stream is timed)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(
        self: _ObservedServicer, request: Message, context: grpc.ServicerContext
    ) -> Iterator[Message]:
        start = time.perf_counter()
        try:
            yield from method(self, request, context)
        except Exception as error:
            _count_error(self, name, error)
            raise
        finally:
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]
