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

from prometheus_client import CollectorRegistry, Counter, Histogram

from embedding_store.errors import grpc_code_name_of

#: Histogram buckets (seconds) of RPC latencies: sub-millisecond lookups up to long dumps.
LATENCY_BUCKETS = (
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


def rpc_metrics(
    registry: CollectorRegistry, prefix: str, service: str, latency_note: str = "server side"
) -> tuple[Histogram, Counter]:
    """The two metrics :func:`observed` records: ``{prefix}_rpc_latency_seconds`` (Histogram
    by method) and ``{prefix}_rpc_errors`` (Counter by method and status code name)."""
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
    return latency, errors


def _count_error(servicer, method: str, error: BaseException) -> None:
    servicer.metrics.errors.labels(method, grpc_code_name_of(error)).inc()


def observed(method):
    """Record latency and failures of a unary (or client-streaming) RPC method."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, request, context):
        start = time.perf_counter()
        try:
            return method(self, request, context)
        except Exception as error:
            _count_error(self, name, error)
            raise
        finally:
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)

    return wrapper


def observed_stream(method):
    """Like :func:`observed` for server-streaming methods (the whole stream is timed)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, request, context):
        start = time.perf_counter()
        try:
            yield from method(self, request, context)
        except Exception as error:
            _count_error(self, name, error)
            raise
        finally:
            self.metrics.latency.labels(name).observe(time.perf_counter() - start)

    return wrapper
