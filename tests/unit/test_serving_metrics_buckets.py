"""Metrics that exist before their first sample and latency buckets that resolve the
prediction server's latencies (tens of microseconds)."""

from __future__ import annotations

import os

import pytest

from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.rpc_metrics import LATENCY_BUCKETS
from embedding_store.worker_metrics import EmbeddingWorkerMetrics
from serving.metrics import ServingMetrics
from tests.unit.python_script import run_python

SERVER_BUCKETS = [
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
    float("inf"),
]


def _bounds(registry, name: str) -> list[float]:
    (family,) = [m for m in registry.collect() if m.name == name]
    return [
        float(s.labels["le"])
        for s in family.samples
        if s.name == f"{name}_bucket" and s.labels.get("protocol", "http") == "http"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "recserve_compute_latency_seconds",
        "recserve_queue_latency_seconds",
        "recserve_embedding_lookup_latency_seconds",
        "recserve_request_latency_seconds",
    ],
)
def test_server_latencies_have_buckets_from_25_microseconds(name):
    metrics = ServingMetrics()
    metrics.request_latency.labels("http")
    assert _bounds(metrics.registry, name) == SERVER_BUCKETS


def test_a_40_microsecond_compute_is_told_from_a_400_microsecond_one():
    metrics = ServingMetrics()
    metrics.compute_latency.observe(0.00004)
    metrics.compute_latency.observe(0.0004)
    bucket = metrics.registry.get_sample_value
    name = "recserve_compute_latency_seconds_bucket"
    assert bucket(name, {"le": "2.5e-05"}) == 0.0
    assert bucket(name, {"le": "5e-05"}) == 1.0
    assert bucket(name, {"le": "0.00025"}) == 1.0
    assert bucket(name, {"le": "0.0005"}) == 2.0


def test_rpc_latencies_keep_their_long_buckets():
    assert LATENCY_BUCKETS[0] == 0.000025 and LATENCY_BUCKETS[-1] == 120.0
    metrics = ParameterServerMetrics(0, 1)
    metrics.latency.labels("Dump")
    bounds = _bounds(metrics.registry, "recserve_ps_rpc_latency_seconds")
    assert bounds == [*SERVER_BUCKETS[:-1], 30.0, 120.0, float("inf")]


@pytest.mark.parametrize("make", [lambda: ParameterServerMetrics(0, 1), EmbeddingWorkerMetrics])
def test_a_shards_sub_millisecond_lookups_are_told_apart(make):
    # A shard answers a serving batch's Lookup in ~50-300 us (server side): with a first
    # bucket at 0.5 ms all of them fell into it, and every quantile read the same.
    metrics = make()
    for seconds in (0.00004, 0.00008, 0.0002, 0.0004):
        metrics.latency.labels("Lookup").observe(seconds)
    prefix = "recserve_ps" if isinstance(metrics, ParameterServerMetrics) else "recserve_worker"
    name = f"{prefix}_rpc_latency_seconds_bucket"
    counts = [
        metrics.registry.get_sample_value(name, {"method": "Lookup", "le": le})
        for le in ("2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005")
    ]
    assert counts == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_reload_outcomes_exist_at_zero():
    sample = ServingMetrics().registry.get_sample_value
    assert sample("recserve_reloads_total", {"outcome": "ok"}) == 0.0
    assert sample("recserve_reloads_total", {"outcome": "failed"}) == 0.0


CODES = ["INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL"]
PS_METHODS = [
    "Lookup",
    "Update",
    "Configure",
    "Dump",
    "Load",
    "ExportRows",
    "ImportRows",
    "Clear",
    "Status",
]
WORKER_METHODS = ["Lookup", "Backward", "Flush", "Configure", "Dump", "Load", "Clear", "Status"]


@pytest.mark.parametrize(
    ("metrics", "name", "methods"),
    [
        (lambda: ParameterServerMetrics(0, 1), "recserve_ps_rpc_errors", PS_METHODS),
        (EmbeddingWorkerMetrics, "recserve_worker_rpc_errors", WORKER_METHODS),
    ],
)
def test_rpc_error_series_exist_at_zero_for_every_method(metrics, name, methods):
    registry = metrics().registry
    (family,) = [m for m in registry.collect() if m.name == name]
    series = {
        (s.labels["method"], s.labels["code"]): s.value
        for s in family.samples
        if s.name == f"{name}_total"
    }
    assert series == {(method, code): 0.0 for method in methods for code in CODES}


def test_checkpoint_age_counts_from_its_creation_and_is_never_negative():
    import time

    metrics = ServingMetrics()
    created = [time.time() - 3600.0]
    metrics.track_checkpoint(lambda: created[0])
    age = metrics.registry.get_sample_value("recserve_checkpoint_age_seconds")
    assert 3600.0 <= age < 3660.0
    created[0] = time.time() + 600.0  # written by a host whose clock runs ahead
    assert metrics.registry.get_sample_value("recserve_checkpoint_age_seconds") == 0.0


def _run_multiprocess(script: str, tmp_path):
    """``script`` in a fresh interpreter in prometheus' multiprocess mode (its files in
    ``tmp_path``): what several server processes of one host share."""
    return run_python(script, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})


_MULTIPROCESS_RELOADS = """
from prometheus_client.parser import text_string_to_metric_families
from serving.metrics import ServingMetrics

metrics = ServingMetrics()
for number in range(100):  # 100 reloads, each version answering one request
    metrics.set_model("m", f"v{number}")
    metrics.requests.labels("http", "m", f"v{number}", "ok").inc()
    metrics.requests.labels("grpc", "unknown", f"v{number}", "NotFoundError").inc()
for family in text_string_to_metric_families(metrics.exposition().decode()):
    for sample in family.samples:
        if sample.name in ("recserve_model_info", "recserve_requests_total"):
            print(sample.name, sorted(sample.labels.items()), sample.value)
"""


def test_replaced_versions_leave_no_series_in_the_metrics_of_a_workers_server(tmp_path):
    # Several processes keep what they stored (a replaced version at 0 in model_info), but a
    # scrape shows only the series of versions some process serves: 100 reloads must not
    # leave 100 versions' series behind.
    result = _run_multiprocess(_MULTIPROCESS_RELOADS, tmp_path)
    assert sorted(result.stdout.split("\n")[:-1]) == [
        "recserve_model_info [('model', 'm'), ('version', 'v99')] 1.0",
        "recserve_requests_total [('model', 'm'), ('outcome', 'ok'), ('protocol', 'http'), "
        "('version', 'v99')] 1.0",
        "recserve_requests_total [('model', 'unknown'), ('outcome', 'NotFoundError'), "
        "('protocol', 'grpc'), ('version', 'v99')] 1.0",
    ]


_MULTIPROCESS_TWO_VERSIONS = """
import sys

from prometheus_client.parser import text_string_to_metric_families
from serving.metrics import ServingMetrics

metrics = ServingMetrics()
metrics.set_model("m", sys.argv[1])
metrics.requests.labels("http", "m", sys.argv[1], "ok").inc()
if len(sys.argv) > 2:  # the second process: report what a scrape sees
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name in ("recserve_model_info", "recserve_requests_total"):
                print(sample.labels["version"], sample.name, sample.value)
"""


def test_every_version_some_process_serves_keeps_its_series(tmp_path):
    # Mid-rollout: one process still serves v1 while another serves v2.
    run_python(
        _MULTIPROCESS_TWO_VERSIONS, "v1",
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )  # fmt: skip
    result = run_python(
        _MULTIPROCESS_TWO_VERSIONS, "v2", "scrape",
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )  # fmt: skip
    assert sorted(result.stdout.split("\n")[:-1]) == [
        "v1 recserve_model_info 1.0",
        "v1 recserve_requests_total 1.0",
        "v2 recserve_model_info 1.0",
        "v2 recserve_requests_total 1.0",
    ]


def test_batch_size_buckets_are_powers_of_two_up_to_4096() -> None:
    metrics = ServingMetrics()
    metrics.batch_size.observe(4096)
    metrics.batch_size.observe(4097)
    bucket = metrics.registry.get_sample_value
    assert _bounds(metrics.registry, "recserve_batch_size") == [
        *(float(2**k) for k in range(13)),
        float("inf"),
    ]
    assert bucket("recserve_batch_size_bucket", {"le": "4096.0"}) == 1.0
    assert bucket("recserve_batch_size_bucket", {"le": "+Inf"}) == 2.0


def test_one_process_reports_only_the_version_it_serves_and_forgets_series() -> None:
    metrics = ServingMetrics()
    sample = metrics.registry.get_sample_value
    metrics.set_model("m", "v1")
    metrics.set_model("m", "v2")
    assert sample("recserve_model_info", {"model": "m", "version": "v2"}) == 1.0
    assert sample("recserve_model_info", {"model": "m", "version": "v1"}) is None
    labels = ("http", "m", "v1", "ok")
    series = {"protocol": "http", "model": "m", "version": "v1", "outcome": "ok"}
    metrics.requests.labels(*labels).inc()
    assert sample("recserve_requests_total", series)
    metrics.forget(metrics.requests, labels)
    assert sample("recserve_requests_total", series) is None
    metrics.forget(metrics.requests, labels)  # a series already gone: nothing to do


def test_pending_requests_are_read_at_each_scrape() -> None:
    metrics = ServingMetrics()
    pending = [3]
    metrics.track_pending(lambda: pending[0])
    assert metrics.registry.get_sample_value("recserve_pending_requests") == 3.0
    pending[0] = 7
    assert metrics.registry.get_sample_value("recserve_pending_requests") == 7.0


def test_an_empty_multiprocess_variable_means_one_process(monkeypatch) -> None:
    from serving.metrics import MULTIPROCESS_VARIABLE

    monkeypatch.setenv(MULTIPROCESS_VARIABLE, "")
    assert ServingMetrics().multiprocess_directory is None


_MULTIPROCESS_GAUGES = """
import os

from prometheus_client.parser import text_string_to_metric_families

child = os.fork()  # another process of the server: its own files in the shared directory
if child == 0:
    from serving.metrics import ServingMetrics

    metrics = ServingMetrics()
    metrics.track_pending(lambda: 2)
    metrics.track(metrics.ready, lambda: 1.0)
    metrics.track(metrics.tier_version_mismatch, lambda: 3.0)
    os._exit(0)
os.waitpid(child, 0)
from serving.metrics import ServingMetrics

metrics = ServingMetrics()
pending = [0]
metrics.track_pending(lambda: pending[0])
metrics.track(metrics.ready, lambda: 0.0)
metrics.track(metrics.tier_version_mismatch, lambda: 1.0)
pending[0] = 5  # a scrape reads the value of now, not the one stored a moment ago
wanted = ("recserve_pending_requests", "recserve_ready", "recserve_embedding_tier_version_mismatch")
for family in text_string_to_metric_families(metrics.exposition().decode()):
    for sample in family.samples:
        if sample.name in wanted:
            print(sample.name, sample.value)
"""


def test_gauges_of_several_processes_combine_as_their_help_says(tmp_path):
    """Pending requests add up; ready is the minimum; version mismatches the maximum."""
    result = _run_multiprocess(_MULTIPROCESS_GAUGES, tmp_path)
    assert sorted(result.stdout.split("\n")[:-1]) == [
        "recserve_embedding_tier_version_mismatch 3.0",
        "recserve_pending_requests 7.0",
        "recserve_ready 0.0",
    ]
