"""Locust users for recserve serving: KServe v2 over HTTP (binary and JSON), the friendly JSON
route, and KServe v2 over gRPC; plus TorchServe users (JSON and binary) for benchmarks/peers.py.

Traffic comes from :mod:`load_tests.traffic`, built against the served model's metadata
(``GET /v2/models/{name}``), so the same file drives the Adult model and the synthetic
Criteo-like one. Request names carry the batch size (``v2-binary b64``) so locust's stats split
by it. Run through ``load_tests/run.py``, or by hand::

    RECSERVE_LT_GRPC=127.0.0.1:8001 locust -f load_tests/locustfile.py --headless \\
        -u 8 -r 8 -t 30s --host http://127.0.0.1:8000 KServeBinaryUser GrpcUser

Settings (environment):

* ``RECSERVE_LT_MODEL``: model name (default ``model``);
* ``RECSERVE_LT_GRPC``: gRPC HOST:PORT (needed by :class:`GrpcUser`);
* ``RECSERVE_LT_VOCAB``: ``.npz`` of known IDs per slot (load_tests/run.py writes one from
  the checkpoint); without it IDs are ``0 .. 9999``;
* ``RECSERVE_LT_BATCHES``: batch size mix, ``SIZE:WEIGHT,...`` (default ``1:6,8:3,64:1``);
* ``RECSERVE_LT_UNKNOWN``: share of unknown IDs (default 0.02); ``RECSERVE_LT_ZIPF``: Zipf
  exponent (default 1.1);
* ``RECSERVE_LT_SEED``: makes the traffic reproducible (which IDs are hot, and each pool's
  draws: a stream per payload kind and locust process, see :func:`traffic.stream_key`);
  unset, every run and process draws its own requests;
* ``RECSERVE_LT_POOL``: payloads per batch size in each pool (default: about 8k rows' worth);
* ``RECSERVE_LT_ROWS``: a CSV or JSON-lines file of raw rows (``.gz`` too) that
  :class:`FriendlyJsonUser` sends instead of slot IDs: for a server with a
  ``--preprocessor`` (the Adult one reads raw columns such as ``age``);
* ``RECSERVE_LT_FINAL_STATS``: where to write the final stats (JSON) when locust quits, after
  the last worker report: locust's ``--csv`` stats file is rewritten only once a second and
  not at shutdown, so it misses the last second's requests and failures;
* ``RECSERVE_LT_WAIT``: seconds each user waits between requests (default 0: closed loop);
* ``RECSERVE_LT_CHECK_ANSWERS``: 1 (default) counts a request as a success only when its
  answer holds one finite prediction per row sent and an ``unknown_ids`` within [0, IDs sent]
  (required from recserve's answers, see :func:`traffic.unknown_ids_problem`); 0 checks the
  status alone (for benchmarks/peers.py's no-work ceiling server, whose fixed answer has one
  prediction);
* ``RECSERVE_LT_METADATA_FILE`` / ``RECSERVE_LT_METADATA_URL``: the model metadata JSON (a
  file, or a recserve base URL) when ``--host`` is not a recserve server (TorchServe);
* ``RECSERVE_LT_TS_MODEL``: TorchServe model name (default: ``RECSERVE_LT_MODEL``).

An empty variable is an unset one; a value that is not what the variable takes (a number that
does not parse or is out of range) stops locust with an error naming the variable and value.
``--host`` and ``RECSERVE_LT_METADATA_URL`` are checked as the client library checks a server
URL (``clients.client.parse_url``: a host, a valid port, no ``user:password@``), and must be
``http://`` or ``https://`` URLs: another stops locust before any user starts, with an error
naming the flag or variable (``load_tests.locust_run.checked_host``). So is
``RECSERVE_LT_GRPC``, as ``grpc://HOST:PORT`` (no scheme of its own, a port, no path, no
``user:password@``: ``load_tests.locust_run.checked_grpc_target``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gevent
import locust.stats as locust_stats
from locust import FastHttpUser, User, constant, events, task
from locust.contrib.fasthttp import ResponseContextManager
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner, WorkerRunner
from locust.stats import RequestStats, StatsEntry

try:  # gRPC's own threads must cooperate with locust's gevent loop
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()
except (ImportError, AttributeError):  # pragma: no cover - depends on the grpcio build
    pass

from clients.codec import HEADER_LENGTH, decode_http_infer, decode_rows_response
from clients.types import PredictResult
from embedding_store.errors import RecserveError
from load_tests import traffic
from load_tests.locust_run import add_rows, batch_size_of, checked_grpc_target, checked_host

MODEL = os.environ.get("RECSERVE_LT_MODEL", "model")
WAIT = traffic.env_number("RECSERVE_LT_WAIT", 0.0, float, lambda s: s >= 0, "seconds >= 0")
POOL_PER_SIZE = (
    traffic.env_number("RECSERVE_LT_POOL", 0, int, lambda n: n >= 0, "an integer >= 0") or None
)
#: 0: count any 200 as a success without reading the answer (benchmarks/peers.py's no-work
#: ceiling server answers one fixed prediction to every request, by design).
CHECK_ANSWERS = bool(
    traffic.env_number("RECSERVE_LT_CHECK_ANSWERS", 1, int, lambda n: n in (0, 1), "0 or 1")
)


def latency_bucket(response_time: float) -> float:
    """The key under which locust's histogram counts a response time (ms): the time to 2
    significant digits (4.567 -> 4.6, 0.81234 -> 0.81, 12.5 -> 12.0, 1234.5 -> 1200.0).

    locust computes every percentile from this histogram; its own keys round to whole ms below
    100 ms (2 significant digits only from 100 ms up), so a p50 of 1.4 ms read 1 and one of
    0.6 ms read 1: a third off at the latencies recserve answers in. 2 digits keep its ~90
    keys per decade of latency (3 digits, ~900, cost the load generator ~4% of a core in
    locust's once-a-second percentiles)."""
    if not 0.0 < response_time < math.inf:  # 0, a negative clock step, NaN, inf: as they are
        return response_time
    return round(response_time, 1 - math.floor(math.log10(response_time)))


if hasattr(locust_stats, "bucket_response_time"):  # locust's bucketing hook (2.47 has it)
    # locust annotates int keys; its percentile and merging code take any number
    locust_stats.bucket_response_time = latency_bucket  # type: ignore[assignment]
    LATENCY_RESOLUTION = "2 significant digits"
else:  # pragma: no cover - an older locust rounds inside StatsEntry
    LATENCY_RESOLUTION = (
        "locust's buckets: whole ms below 100 ms, 10 ms below 1 s, 2 significant digits above"
    )

_pools: dict[str, traffic.PayloadPool] = {}
_inputs: list[traffic.ModelInputs] = []
_environments: list[Environment] = []


def model_inputs(host: str | None) -> traffic.ModelInputs:
    """The served model's inputs, read once per load-generator process (from ``host``, a
    recserve base URL, unless the metadata variables say otherwise)."""
    if not _inputs and os.environ.get("RECSERVE_LT_METADATA_FILE"):
        metadata = json.loads(Path(os.environ["RECSERVE_LT_METADATA_FILE"]).read_text())
        _inputs.append(traffic.ModelInputs.from_metadata(metadata))
    if not _inputs:
        base = os.environ.get("RECSERVE_LT_METADATA_URL") or host
        if not base:
            raise RuntimeError(
                "the model's inputs need --host, RECSERVE_LT_METADATA_URL or "
                "RECSERVE_LT_METADATA_FILE"
            )
        for attempt in range(20):
            try:
                metadata = traffic.fetch_metadata(base, MODEL)
                break
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
        if not _inputs:
            _inputs.append(traffic.ModelInputs.from_metadata(metadata))
    return _inputs[0]


def payload_pool(kind: str, host: str | None, process_index: int = 0) -> traffic.PayloadPool:
    """A pool of pre-encoded requests of ``kind``, shared by the users of this process, drawn
    from the stream of this kind and process (``process_index``: locust's worker index)."""
    pool = _pools.get(kind)
    if pool is None:
        vocab_path = os.environ.get("RECSERVE_LT_VOCAB")
        vocab = traffic.load_vocab(vocab_path) if vocab_path else None
        rows_path = os.environ.get("RECSERVE_LT_ROWS") if kind == "friendly" else None
        generator = traffic.TrafficGenerator(
            model_inputs(host),
            traffic.TrafficProfile.from_env(),
            vocab,
            stream=traffic.stream_key(kind, process_index),
        )
        pool = _pools.setdefault(
            kind,
            traffic.PayloadPool(
                generator,
                kind,
                per_size=POOL_PER_SIZE,
                model=MODEL,
                rows=traffic.load_rows(rows_path) if rows_path else None,
            ),
        )
    return pool


def _process_index(user: User) -> int:
    """locust's index of this load-generator process (0 without ``--processes``)."""
    return int(getattr(user.environment.runner, "worker_index", 0) or 0)


# --------------------------------------------------------------------------- final stats
def _stats_row(entry: StatsEntry) -> dict[str, Any]:
    """One row as load_tests/locust_run.py's ``read_stats`` returns them (percentiles over the
    run)."""

    def percentile(fraction: float) -> float | None:
        return float(entry.get_response_time_percentile(fraction)) if entry.num_requests else None

    return {
        "type": entry.method or "",
        "name": entry.name,
        "requests": entry.num_requests,
        "failures": entry.num_failures,
        "rps": round(entry.total_rps, 2),
        "p50_ms": percentile(0.5),
        "p95_ms": percentile(0.95),
        "p99_ms": percentile(0.99),
        "avg_ms": round(entry.avg_response_time, 2),
        "max_ms": round(float(entry.max_response_time), 2),
    }


def final_stats(
    stats: RequestStats, exceptions: Mapping[Any, Mapping[str, Any]], exit_code: int
) -> dict[str, Any]:
    """The whole run's stats as a JSON-able dict: per request name (by label, then batch size:
    ``v2-json b8`` before ``v2-json b64``), then ``Aggregated``; each row with its rows and
    rows/s (``locust_run.add_rows``)."""

    def order(entry: StatsEntry) -> tuple[str, int, str, str]:
        size = batch_size_of(entry.name)
        label = entry.name.rpartition(" b")[0] if size is not None else entry.name
        return (label, size or 0, entry.name, entry.method or "")

    entries = sorted(stats.entries.values(), key=order)
    return {
        "exit_code": exit_code,
        "written_unix": time.time(),
        "latency_resolution": LATENCY_RESOLUTION,
        "stats": add_rows([_stats_row(entry) for entry in [*entries, stats.total]]),
        "errors": [
            {"name": e.name, "method": e.method, "error": str(e.error), "count": e.occurrences}
            for e in stats.errors.values()
        ],
        "exceptions": [
            {"count": int(e.get("count", 0)), "msg": str(e.get("msg", ""))}
            for e in exceptions.values()
        ],
    }


def check_urls(host: str | None) -> None:
    """Exit (status 1) with an error naming the flag or variable when locust's ``--host``
    or ``RECSERVE_LT_METADATA_URL`` is not a server URL the client library would take
    (:func:`load_tests.locust_run.checked_host`), or ``RECSERVE_LT_GRPC`` not a gRPC
    ``HOST:PORT`` (:func:`load_tests.locust_run.checked_grpc_target`): before any user
    starts, not as one failed request (or user start) after another."""
    metadata_url = os.environ.get("RECSERVE_LT_METADATA_URL")
    try:
        for where, url in (("--host", host), ("RECSERVE_LT_METADATA_URL", metadata_url)):
            if url and url.strip():  # an empty variable is an unset one
                checked_host(url, where)
        grpc_target()
    except ValueError as error:
        sys.exit(f"error: {error}")


def grpc_target() -> str | None:
    """``RECSERVE_LT_GRPC``, the gRPC ``HOST:PORT`` the :class:`GrpcUser` connects to,
    stripped and checked (:func:`load_tests.locust_run.checked_grpc_target`; ValueError
    naming the variable); None when unset or blank (an empty variable is an unset one).
    The start-up check and the users read it here alike: a user that took it unstripped
    connected to ``grpc:// HOST:PORT``, which the check had passed."""
    target = os.environ.get("RECSERVE_LT_GRPC", "").strip()
    return checked_grpc_target(target, "RECSERVE_LT_GRPC") if target else None


@events.init.add_listener
def _remember_environment(environment: Environment, **_kwargs: Any) -> None:
    check_urls(environment.host)
    _environments[:] = [environment]
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        _pools_ready.clear()
        runner.register_message(POOLS_READY, _count_pools_ready)
        return
    built = prebuild_pools(environment)
    if isinstance(runner, WorkerRunner):  # built or not: the master waits for every worker
        runner.send_message(POOLS_READY, {"built": built})


#: A worker's message to its master: its pools are built (or left to its users).
POOLS_READY = "recserve_pools_ready"
#: The most seconds a master waits for its workers' pools before it starts the load.
POOLS_WAIT_S = 60.0
_pools_ready: set[str] = set()


def _count_pools_ready(environment: Environment, msg: Any, **_kwargs: Any) -> None:
    _pools_ready.add(str(msg.node_id))


@events.test_start.add_listener
def _start_when_the_workers_pools_are_built(environment: Environment, **_kwargs: Any) -> None:
    """On the master of ``--processes``: wait (at most :data:`POOLS_WAIT_S`) until every
    worker built its pools, then restart the stats' clock. locust's req/s divides by the time
    since it cleared its stats, just before this event, while each worker built its pools (CPU
    work that blocks its users, ~0.5-1 s): a 5 s run of 2 processes read 582 req/s of a server
    answering ~730. The users start after this returns, and ``-t`` counts from then too."""
    runner = environment.runner
    if not isinstance(runner, MasterRunner):
        return
    deadline = time.monotonic() + POOLS_WAIT_S
    while len(_pools_ready) < runner.worker_count and time.monotonic() < deadline:
        gevent.sleep(0.05)  # the master's greenlets receive the workers' messages meanwhile
    runner.stats.reset_all()  # nothing was sent yet: only the clock moves


def prebuild_pools(environment: Environment) -> list[str]:
    """Build the payload pools of the run's user classes now, before the test starts, when
    this process runs users (no ``--processes``, or a worker of it, whose index, its pools'
    stream, locust's master sent when it connected); returns the kinds built.

    Built in the users' ``on_start`` instead, they took the first ~0.5-1 s of the run (CPU
    work, which blocks every greenlet), and locust's req/s divides by the time since the
    start: a 6 s run read 711 req/s of a server answering ~820. A worker whose master sent no
    index (an older locust) leaves them to its users. A pool that cannot be built here (no
    metadata yet) is left to ``on_start``, which reports the error as a task error."""
    runner = environment.runner
    if isinstance(runner, LocalRunner):
        index = 0
    elif isinstance(runner, WorkerRunner) and int(getattr(runner, "worker_index", -1)) >= 0:
        index = int(runner.worker_index)
    else:
        return []
    built = []
    for kind in dict.fromkeys(getattr(c, "kind", None) for c in environment.user_classes):
        if kind in traffic.PAYLOAD_KINDS:
            try:
                payload_pool(kind, environment.host, index)
            except Exception:  # on_start tries again and reports it
                continue
            built.append(kind)
    return built


@events.quit.add_listener
def _write_final_stats(exit_code: int, **_kwargs: Any) -> None:
    """Fired by locust's shutdown after ``runner.quit()`` (which waits for the workers' last
    reports), unlike the ``--csv`` stats file: the run's complete numbers."""
    path = os.environ.get("RECSERVE_LT_FINAL_STATS")
    runner = _environments[0].runner if _environments else None
    if not path or runner is None or isinstance(runner, WorkerRunner):
        return  # a worker's own stats are reported to the master, not final
    document = final_stats(_environments[0].stats, runner.exceptions, exit_code)
    temporary = Path(f"{path}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(document, indent=1))
    os.replace(temporary, path)  # whole or absent: run.py treats absent as "locust failed"


def _check(
    response: ResponseContextManager,
    what: str,
    batch_size: int | None = None,
    decode: Callable[[ResponseContextManager], PredictResult] | None = None,
    *,
    ids_sent: int | None = None,
    unknown_ids_promised: bool = False,
) -> None:
    """Count ``response`` as a success only when it is a 200 and, given ``decode`` (the
    answer's parser), its answer decodes into one finite prediction per row of the
    ``batch_size`` rows sent, with an ``unknown_ids`` within [0, ``ids_sent``] (required when
    ``unknown_ids_promised``: :func:`traffic.unknown_ids_problem`); else as a failure naming
    ``what`` and the problem."""
    if response.status_code != 200:
        # locust sets .error only for what it counts as failed (not a 204 or a 3xx it did
        # not follow, which a proxy in front of the server may send)
        error = getattr(response, "error", None)
        text = (response.text or "")[:200] if response.content else str(error or "empty body")
        response.failure(f"{what}: HTTP {response.status_code}: {text}")
        return
    if decode is not None and batch_size is not None:
        try:
            result = decode(response)
            problem = traffic.answer_problem(
                result.predictions, batch_size
            ) or traffic.unknown_ids_problem(result.parameters, ids_sent, unknown_ids_promised)
        except RecserveError as error:  # the decoders' word for a malformed answer
            problem = str(error)[:200]
        if problem:
            response.failure(f"{what}: HTTP 200 with a wrong answer: {problem}")
            return
    response.success()


def _kserve_answer(response: ResponseContextManager) -> PredictResult:
    """A KServe v2 REST answer: JSON, or JSON + binary outputs (the header's length in the
    ``Inference-Header-Content-Length`` response header)."""
    length = response.headers.get(HEADER_LENGTH) if response.headers is not None else None
    return decode_http_infer(response.content or b"", None if length is None else str(length))


def _rows_answer(response: ResponseContextManager) -> PredictResult:
    """The friendly route's ``{"predictions": [[p], ...], ...}``."""
    return decode_rows_response(response.content or b"")


class _InferUser(FastHttpUser):
    abstract = True
    wait_time = constant(WAIT)
    kind = "json"
    label = "v2-json"
    path = f"/v2/models/{MODEL}/infer"
    content_type = "application/json"
    #: Whether the answers carry ``unknown_ids`` (recserve's v2 and friendly ones do).
    promises_unknown_ids = True

    def on_start(self) -> None:
        self.pool = payload_pool(self.kind, self.host, _process_index(self))

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return {"Content-Type": self.content_type}

    def answer(self, response: ResponseContextManager) -> PredictResult:
        """The decoded answer (its predictions are checked against the rows sent)."""
        return _kserve_answer(response)

    @task
    def infer(self) -> None:
        payload = self.pool.pick()
        with self.client.post(
            self.path,
            # locust annotates data as str | dict, but sends bytes as they are
            data=payload.body,  # type: ignore[arg-type]
            headers=self.headers(payload),
            name=f"{self.label} b{payload.batch_size}",
            catch_response=True,
        ) as response:
            _check(
                response,
                self.label,
                payload.batch_size,
                self.answer if CHECK_ANSWERS else None,
                ids_sent=payload.ids,
                unknown_ids_promised=self.promises_unknown_ids,
            )


class KServeJsonUser(_InferUser):
    """``POST /v2/models/{name}/infer`` with KServe v2 JSON tensors."""


def binary_headers(content_type: str, payload: traffic.Payload) -> dict[str, str]:
    """Headers of a binary tensor extension request: the JSON header's length."""
    return {
        "Content-Type": content_type,
        "Inference-Header-Content-Length": str(payload.header_length),
    }


class KServeBinaryUser(_InferUser):
    """``POST /v2/models/{name}/infer`` with the binary tensor extension (binary outputs)."""

    kind = "binary"
    label = "v2-binary"
    content_type = "application/octet-stream"

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return binary_headers(self.content_type, payload)


class FriendlyJsonUser(_InferUser):
    """``POST /v1/models/{name}:predict`` with ``{"instances": [...]}``: slot IDs by name, or
    the raw rows of ``RECSERVE_LT_ROWS`` for a server with a ``--preprocessor``."""

    kind = "friendly"
    label = "v1-predict"
    path = f"/v1/models/{MODEL}:predict"

    def answer(self, response: ResponseContextManager) -> PredictResult:
        return _rows_answer(response)


class TorchServeJsonUser(_InferUser):
    """TorchServe's ``POST /predictions/{name}`` with the same KServe v2 JSON bodies as
    :class:`KServeJsonUser` (benchmarks/peers_handler.py decodes them)."""

    label = "torchserve-json"
    path = f"/predictions/{os.environ.get('RECSERVE_LT_TS_MODEL', MODEL)}"
    #: benchmarks/peers_handler.py answers predictions alone: a missing one is no failure.
    promises_unknown_ids = False


class TorchServeBinaryUser(TorchServeJsonUser):
    """TorchServe's ``POST /predictions/{name}`` with the same binary tensor extension bodies
    and headers as :class:`KServeBinaryUser` (binary outputs; peers_handler.py decodes them)."""

    kind = "binary"
    label = "torchserve-binary"
    content_type = "application/octet-stream"

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return binary_headers(self.content_type, payload)


class GrpcUser(User):
    """KServe v2 ``ModelInfer`` over gRPC through the project's client
    (:class:`clients.RecserveClient`, raw tensor contents), reported to locust as ``grpc``.

    Retries are off, so every failed call is counted, like the HTTP users' failures."""

    wait_time = constant(WAIT)
    kind = "grpc"

    def on_start(self) -> None:
        from clients import RecserveClient

        target = grpc_target()
        if target is None:
            raise RuntimeError("GrpcUser needs RECSERVE_LT_GRPC=HOST:PORT")
        self.pool = payload_pool("grpc", self.host, _process_index(self))
        self.client = RecserveClient(f"grpc://{target}", model_name=MODEL, timeout=10.0, retries=0)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def infer(self) -> None:
        payload = self.pool.pick()
        arrays = payload.arrays
        if arrays is None:
            raise RuntimeError("a grpc pool's payload has no tensors")
        started = time.perf_counter()
        length, exception, result = 0, None, None
        try:
            result = self.client.infer(arrays)
        except RecserveError as error:
            exception = error
        elapsed_ms = (time.perf_counter() - started) * 1000.0  # the call's, not the check's
        if result is not None:
            length = result.predictions.nbytes
            problem = (
                traffic.answer_problem(result.predictions, payload.batch_size)
                or traffic.unknown_ids_problem(result.parameters, payload.ids, True)
                if CHECK_ANSWERS
                else None
            )
            if problem:  # answered, but not what was asked: a failed request
                exception = RecserveError(f"wrong answer: {problem}")
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"v2-grpc b{payload.batch_size}",
            response_time=elapsed_ms,
            response_length=length,
            exception=exception,
            context={},
        )


#: Short names (load_tests/run.py --users-of) -> user classes.
USER_CLASSES = {
    "binary": KServeBinaryUser,
    "json": KServeJsonUser,
    "friendly": FriendlyJsonUser,
    "grpc": GrpcUser,
    "torchserve": TorchServeJsonUser,
    "torchserve-binary": TorchServeBinaryUser,
}
