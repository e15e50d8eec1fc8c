"""embedding_store.rpc_metrics: what the embedding tier's servicers record per RPC method.

Requirements checked: the error series of every method and precreated status code exist at 0
from the start (so the first failure shows in ``increase()``); ``observed`` and
``observed_stream`` time every call, success or failure, under the method's own name, count a
failure once under its gRPC status code name and re-raise it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from embedding_store.errors import DeadlineExceededError, NotFoundError
from embedding_store.rpc_metrics import (
    LATENCY_BUCKETS,
    PRECREATED_ERROR_CODES,
    observed,
    observed_stream,
    rpc_metrics,
    service_methods,
)


@dataclass
class _Metrics:
    latency: Histogram
    errors: Counter


class _Servicer:
    """A servicer with one unary and one server-streaming method, decorated as the real ones."""

    def __init__(self, registry: CollectorRegistry) -> None:
        latency, errors = rpc_metrics(registry, "test", "Test", methods=["Lookup", "Dump"])
        self.metrics = _Metrics(latency, errors)
        self.fail_with: Exception | None = None

    @observed
    def Lookup(self, request: int, context: object) -> int:  # gRPC method names are CamelCase
        if self.fail_with is not None:
            raise self.fail_with
        return request + 1

    @observed_stream
    def Dump(self, request: int, context: object) -> Iterator[int]:
        for index in range(request):
            if self.fail_with is not None and index == 1:
                raise self.fail_with
            yield index


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_service_methods_follow_the_proto() -> None:
    assert service_methods("ParameterServer") == (
        "Lookup",
        "Update",
        "Configure",
        "Dump",
        "Load",
        "ExportRows",
        "ImportRows",
        "Clear",
        "Status",
    )
    assert service_methods("EmbeddingWorker") == (
        "Lookup",
        "Backward",
        "Flush",
        "Configure",
        "Dump",
        "Load",
        "Clear",
        "Status",
    )
    assert service_methods("NoSuchService") == ()


def test_error_series_of_every_method_and_code_start_at_zero() -> None:
    registry = CollectorRegistry()
    latency, errors = rpc_metrics(registry, "ps", "ParameterServer")
    assert isinstance(latency, Histogram) and isinstance(errors, Counter)
    assert PRECREATED_ERROR_CODES == (
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
    )
    for method in service_methods("ParameterServer"):
        for code in PRECREATED_ERROR_CODES:
            assert _value(registry, "ps_rpc_errors_total", method=method, code=code) == 0.0
    # Rarer codes and unknown methods appear only with their first failure.
    assert _value(registry, "ps_rpc_errors_total", method="Lookup", code="NOT_FOUND") is None
    assert _value(registry, "ps_rpc_errors_total", method="Nope", code="INTERNAL") is None
    # Explicit methods replace the service's.
    explicit = CollectorRegistry()
    rpc_metrics(explicit, "w", "EmbeddingWorker", methods=["Only"])
    assert _value(explicit, "w_rpc_errors_total", method="Only", code="UNAVAILABLE") == 0.0
    assert _value(explicit, "w_rpc_errors_total", method="Lookup", code="UNAVAILABLE") is None


def test_latency_histogram_uses_the_rpc_buckets_and_describes_the_service() -> None:
    registry = CollectorRegistry()
    rpc_metrics(registry, "w", "EmbeddingWorker", latency_note="client side", methods=[])
    (family,) = [m for m in registry.collect() if m.name == "w_rpc_latency_seconds"]
    assert family.documentation == "Latency of EmbeddingWorker RPCs by method (client side)."
    (errors,) = [m for m in registry.collect() if m.name == "w_rpc_errors"]
    assert errors.documentation == "Failed EmbeddingWorker RPCs by method and status code."
    assert tuple(sorted(LATENCY_BUCKETS)) == LATENCY_BUCKETS
    assert (LATENCY_BUCKETS[0], LATENCY_BUCKETS[-1]) == (0.000025, 120.0)
    servicer = _Servicer(registry)  # another prefix in the same registry
    servicer.Lookup(1, None)
    for bucket in LATENCY_BUCKETS:
        # One sub-second call: counted in every bucket from 1 s up.
        count = _value(registry, "test_rpc_latency_seconds_bucket", method="Lookup", le=str(bucket))
        assert count is not None
        if bucket >= 1.0:
            assert count == 1.0


def test_observed_times_successes_and_counts_failures_by_code() -> None:
    registry = CollectorRegistry()
    servicer = _Servicer(registry)
    assert servicer.Lookup(41, None) == 42
    assert servicer.Lookup.__name__ == "Lookup"  # functools.wraps: grpc looks methods up by name
    assert _value(registry, "test_rpc_latency_seconds_count", method="Lookup") == 1.0
    assert _value(registry, "test_rpc_errors_total", method="Lookup", code="INTERNAL") == 0.0

    servicer.fail_with = NotFoundError("no such table")
    with pytest.raises(NotFoundError, match="no such table"):
        servicer.Lookup(1, None)
    servicer.fail_with = RuntimeError("bug")
    with pytest.raises(RuntimeError, match="bug"):
        servicer.Lookup(1, None)
    assert _value(registry, "test_rpc_errors_total", method="Lookup", code="NOT_FOUND") == 1.0
    assert _value(registry, "test_rpc_errors_total", method="Lookup", code="INTERNAL") == 1.0
    # Failures are timed too; nothing is recorded under the other method.
    assert _value(registry, "test_rpc_latency_seconds_count", method="Lookup") == 3.0
    assert _value(registry, "test_rpc_latency_seconds_count", method="Dump") is None
    assert _value(registry, "test_rpc_errors_total", method="Dump", code="INTERNAL") == 0.0


def test_observed_stream_times_the_whole_stream_and_counts_its_failure() -> None:
    registry = CollectorRegistry()
    servicer = _Servicer(registry)
    stream = servicer.Dump(3, None)
    assert servicer.Dump.__name__ == "Dump"
    # Nothing is recorded before the stream is consumed, once when it ends.
    assert _value(registry, "test_rpc_latency_seconds_count", method="Dump") is None
    assert list(stream) == [0, 1, 2]
    assert _value(registry, "test_rpc_latency_seconds_count", method="Dump") == 1.0

    servicer.fail_with = DeadlineExceededError("too slow")
    failing = servicer.Dump(3, None)
    assert next(failing) == 0
    with pytest.raises(DeadlineExceededError, match="too slow"):
        next(failing)
    code = "DEADLINE_EXCEEDED"
    assert _value(registry, "test_rpc_errors_total", method="Dump", code=code) == 1.0
    assert _value(registry, "test_rpc_errors_total", method="Dump", code="INTERNAL") == 0.0
    assert _value(registry, "test_rpc_latency_seconds_count", method="Dump") == 2.0
    assert _value(registry, "test_rpc_latency_seconds_count", method="Lookup") is None
