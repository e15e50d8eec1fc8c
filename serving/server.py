"""The ``recserve serve`` process: HTTP (FastAPI/uvicorn) and gRPC front ends over one core.

Lifecycle: load + warm the checkpoint (readiness false until then), start both front ends,
optionally watch the checkpoint for new versions, and on SIGTERM/SIGINT flip readiness off,
drain in-flight requests within the grace period, stop both servers and exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from embedding_store import model_checkpoint
from embedding_store.errors import (
    FailedPreconditionError,
    PermissionDeniedError,
    RecserveError,
    UnavailableError,
)
from embedding_store.gc_tuning import freeze_long_lived_objects, space_out_young_collections
from embedding_store.stop_signal import StopRequest, stop_when_parent_exits
from serving.metrics import CONTENT_TYPE, RELOAD_OUTCOMES
from serving.model import LoadedModel, load_model
from serving.options import ServeOptions
from serving.preprocessor import load_preprocessor
from serving.processes import _address_family, serve_processes
from serving.service import PredictionService
from serving.tls import reloading_server_tls

if TYPE_CHECKING:
    import grpc
    from fastapi import FastAPI

    from serving.grpc_frontend import GrpcHealth

log = logging.getLogger(__name__)


class PredictionServer:
    """Both front ends around one :class:`PredictionService`; start(), then stop()."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.service: PredictionService | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc: grpc.Server | None = None
        self._health: GrpcHealth | None = None
        self._stop = threading.Event()  # set from the main thread: the watcher's cue
        self._stop_request = StopRequest()  # what signal handlers set
        self._watcher: threading.Thread | None = None

    def _started(self) -> PredictionService:
        """The service: start() creates it before anything that calls this can run."""
        if self.service is None:
            raise FailedPreconditionError("the prediction server is not started")
        return self.service

    def _load(self, checkpoint: str | None) -> LoadedModel:
        o = self.options
        return load_model(
            checkpoint or o.checkpoint,
            name=o.model_name,
            embedding_workers=list(o.embedding_workers) or None,
            embedding_ps=list(o.embedding_ps) or None,
            output_transform=o.output_transform,
            fallback_policy=o.fallback_policy,
            lookup_timeout=o.lookup_timeout,
            onednn_min_rows=o.onednn_min_rows,
            startup_timeout=o.startup_timeout,
        )

    def start(self) -> PredictionServer:
        import torch

        from serving.grpc_frontend import build_grpc_server
        from serving.http_admin import AdminHooks
        from serving.http_app import SMALL_BODY_BYTES, create_app
        from serving.http_fast_path import InferFastPath
        from serving.http_protocol import REFUSED_REASONS, infer_protocol, protocol_is_supported

        o = self.options
        warning = self.reload_root_warning()
        if warning:
            log.warning("%s", warning)
        # Checked before the model loads and anything binds (recserve serve checks them
        # earlier still; this covers servers started from code). Both front ends then take
        # renewed files from it on new handshakes (serving.tls).
        tls_files = reloading_server_tls(
            o.tls_cert, o.tls_key, o.tls_client_ca, interval=o.tls_reload_seconds
        )
        tls = tls_files.tls if tls_files else None
        # Before the model loads, as the TLS files: a mistyped --preprocessor must not cost
        # a model load (of every --workers process) to find.
        preprocessor = load_preprocessor(o.preprocessor) if o.preprocessor else None
        torch.set_num_threads(o.threads)
        model = self._load(None)
        self.service = PredictionService(
            model,
            loader=self._load,
            max_batch_size=o.max_batch_size,
            max_request_batch_size=o.max_request_batch_size,
            max_queue_delay=o.max_queue_delay_ms / 1000.0,
            max_queue_size=o.max_queue_size,
            default_timeout=o.request_timeout,
            preprocessor=preprocessor,
        )
        app = create_app(
            self.service,
            max_body_bytes=o.max_body_bytes,
            max_decompressed_bytes=o.max_decompressed_bytes,
            admin=AdminHooks(reload=self._admin_reload, token=o.admin_token),
        )
        self._mount_metrics(app)
        if tls_files is not None:
            tls_reloads = self.service.metrics.tls_reloads
            for outcome in RELOAD_OUTCOMES:  # at 0: the first failure shows in increase()
                tls_reloads.labels(outcome)
            tls_files.files.add_listener(lambda outcome: tls_reloads.labels(outcome).inc())
        http_socket = socket.socket(_address_family(o.host), socket.SOCK_STREAM)
        http_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if o.reuse_port:  # the kernel spreads connections over the server processes
            http_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            http_socket.bind((o.host, o.http_port))
        except OSError as error:
            http_socket.close()
            raise UnavailableError(
                f"cannot listen for HTTP on {o.host}:{o.http_port}: {error.strerror or error} "
                "(is another server on that port? --http-port 0 picks a free one)"
            ) from None
        self.http_port = http_socket.getsockname()[1]
        fast_path = InferFastPath(app)
        http_refused = self.service.metrics.http_refused
        for reason in REFUSED_REASONS:  # at 0: the first refusal shows in increase()
            http_refused.labels(reason)
        config = uvicorn.Config(
            fast_path,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # The client address is the socket's peer: X-Forwarded-For must never make a
            # remote client look like loopback (POST /admin/reload trusts loopback).
            proxy_headers=False,
            # Small infer requests skip the ASGI cycle (serving.http_protocol).
            http=infer_protocol(
                fast_path.handler,
                SMALL_BODY_BYTES,
                read_timeout=o.read_timeout_seconds,
                max_connections=o.max_connections,
                max_body_bytes_in_flight=o.body_bytes_in_flight(),
                on_refused=lambda reason: http_refused.labels(reason).inc(),
            )
            if protocol_is_supported()
            else "auto",
            # Only for uvicorn's own protocol (an unsupported uvicorn): it answers 503
            # beyond this many connections or requests, and has no body budget.
            limit_concurrency=None if protocol_is_supported() else o.max_connections,
            # HTTPS: asyncio's SSL transport sits under the protocol, which reads and
            # writes only through its transport, so the fast path is the same over TLS.
            **(tls.uvicorn_options() if tls else {}),
        )
        if tls_files is not None:
            config.load()  # makes uvicorn's SSL context (uvicorn.Server skips a loaded config)
            if config.ssl is None:
                raise FailedPreconditionError("uvicorn made no SSL context for --tls-cert")
            tls_files.attach(config.ssl)
        self._uvicorn = uvicorn.Server(config)
        self._http_thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [http_socket]}, daemon=True
        )
        self._http_thread.start()
        self._grpc, self.grpc_port, self._health = build_grpc_server(
            self.service,
            host=o.host,
            port=o.grpc_port,
            reuse_port=o.reuse_port,
            max_request_bytes=o.max_body_bytes,
            maximum_concurrent_rpcs=o.max_concurrent_rpcs,
            credentials=tls_files.grpc_credentials() if tls_files else None,
        )
        self._grpc.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise UnavailableError(
                    f"the HTTP server on {o.host}:{self.http_port} did not start (see the log)"
                )
            time.sleep(0.01)
        freeze_long_lived_objects()  # model, torch, apps: out of every later collection
        space_out_young_collections()
        self._health.set_serving(True)
        if o.watch_seconds > 0:
            self._watcher = threading.Thread(target=self._watch, daemon=True)
            self._watcher.start()
        print(
            f"recserve serving model {o.model_name!r} version {model.version}: "
            f"HTTP listening on {o.host}:{self.http_port}, "
            f"gRPC listening on {o.host}:{self.grpc_port}" + (f"; {tls.describe()}" if tls else ""),
            flush=True,
        )
        return self

    def _mount_metrics(self, app: FastAPI) -> None:
        from fastapi import Response

        metrics = self._started().metrics

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            # On the event loop (1-2 ms), as the health routes: in the thread pool a scrape
            # queued behind requests waiting there for their answers (friendly ones, large
            # bodies): 8.5 s with 45 waiting on a hung shard, past a scrape's timeout just
            # when the metrics matter.
            return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    def _admin_reload(self, checkpoint: str | None) -> dict[str, Any]:
        """``POST /admin/reload``: one process of a ``--workers`` server cannot reload the
        others, and a reload that reached one of them would leave two versions served."""
        if self.options.reuse_port:
            raise FailedPreconditionError(
                "this server runs several processes (--workers): a reload would reach only "
                "the one that got this request; use --watch-seconds (every process follows "
                "the checkpoint path) or restart the server"
            )
        if checkpoint is not None:
            # A checkpoint's TorchScript model is code: only directories under the root the
            # operator chose are loaded (symlinks resolved first).
            root = self.reload_root
            resolved = Path(checkpoint).resolve()
            if not resolved.is_relative_to(root):
                raise PermissionDeniedError(
                    f"checkpoint {checkpoint} is outside --reload-root {root}; reloads load "
                    "only checkpoints under it"
                )
            # The path that was checked is the one loaded: a symlink the request named, swapped
            # to point elsewhere between the check and the load, must not be followed again.
            checkpoint = str(resolved)
        return self._started().reload(checkpoint)

    @property
    def reload_root(self) -> Path:
        """Where ``POST /admin/reload`` may load from: ``--reload-root``, by default the
        directory that holds ``--checkpoint`` (where new versions are written next to it)."""
        root = self.options.reload_root or Path(self.options.checkpoint).resolve().parent
        return Path(root).resolve()

    def reload_root_warning(self) -> str | None:
        """What to warn about at start-up when every user of the host may write to the
        reload root (``/tmp``, or a mode 0777 folder): any of them could put a checkpoint
        there, whose TorchScript is code, and have it loaded from loopback, which needs no
        token. None when the root is not world-writable, is on a read-only mount, or reloads
        are off (``--workers``)."""
        if self.options.reuse_port:
            return None
        root = self.reload_root
        try:
            if not root.stat().st_mode & stat.S_IWOTH:
                return None
            if os.statvfs(root).f_flag & os.ST_RDONLY:
                return None  # a read-only mount (Kubernetes' /checkpoints): mode 0777 or not
        except OSError:
            return None  # nothing there yet: reloads of it fail on their own
        return (
            f"--reload-root {root} is writable by every user of this host: any of them could "
            "put a checkpoint (its TorchScript is code) there for POST /admin/reload to load, "
            "and loopback clients need no token; use a directory only your trainers can write"
        )

    def _watch(self) -> None:
        """Poll the checkpoint directory; load a new complete version when one appears.

        It compares the path's version with the last one loaded from there (what that
        reload loaded, which may be newer than what the poll read), not with the served
        one: a checkpoint loaded by ``POST /admin/reload`` from elsewhere stays served
        until the watched path itself changes. A version that fails to load is tried again
        after a back-off (:data:`RELOAD_RETRY_SECONDS`, doubling up to
        :data:`RELOAD_RETRY_MAX_SECONDS`): the failure may pass (files still being copied
        in, an embedding tier that is down), and a broken checkpoint is not retried on
        every poll."""
        service = self._started()
        loaded = service.model.version  # what start() loaded from this path
        failed: str | None = None
        retry_at = backoff = 0.0
        while not self._stop.wait(self.options.watch_seconds):
            try:
                version = model_checkpoint.read_manifest(self.options.checkpoint).version
            except RecserveError:
                continue  # being replaced right now, or incomplete: look again later
            except Exception:  # a bug must not end the watch: the next version may load
                log.exception("reading the manifest of %s failed", self.options.checkpoint)
                continue
            if version == loaded or (version == failed and time.monotonic() < retry_at):
                continue
            try:
                # The version it loads, not the one read above: another may have been
                # published meanwhile, and this one published again later must be loaded.
                served = service.reload(None)["version"]
            except Exception as error:  # a bug must not end the watch either
                if self._stop.is_set():
                    return  # stopping: close() refused to serve what it loaded
                if not isinstance(error, RecserveError):
                    log.exception("reloading version %s failed", version)
                backoff = (
                    min(2 * backoff, RELOAD_RETRY_MAX_SECONDS)
                    if version == failed
                    else max(RELOAD_RETRY_SECONDS, self.options.watch_seconds)
                )
                failed, retry_at = version, time.monotonic() + backoff
                log.warning("will try version %s again in %.0f s", version, backoff)
                continue
            loaded, failed = served, None

    def wait(self) -> None:
        """Until a stop is asked for (:meth:`request_stop`, a signal)."""
        self._stop_request.wait()
        self._stop.set()

    def request_stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Ask for a stop; a signal handler: takes no lock (embedding_store.stop_signal)."""
        self._stop_request.handler(signum, frame)

    def stop(self) -> bool:
        """Readiness off, drain, stop both servers: all within one grace period (plus ~4 s
        at most to close what is left), so an orchestrator's kill timeout can be sized."""
        self._stop.set()
        deadline = time.monotonic() + self.options.grace_seconds

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        drained = True
        if self.service is not None:
            self.service.stop_accepting()
            if self._health is not None:
                self._health.set_serving(False)
            drained = self.service.drain(self.options.grace_seconds)
            # Before the front ends stop, so that what is left when the grace runs out gets
            # its answer while they can still send it (after them, its connection would
            # just close): requests still queued get 503 / UNAVAILABLE at once, and a batch
            # still running (a stalled embedding tier) gets a second more, then its model
            # closes, which fails its lookups with UNAVAILABLE.
            self.service.close(wait=max(1.0, remaining()))
        if self._grpc is not None:
            self._grpc.stop(grace=min(1.0, max(0.1, remaining()))).wait()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._http_thread is not None:
                # Requests still arriving (a slow upload) get what is left of the grace period.
                self._http_thread.join(timeout=max(0.5, remaining()))
                if self._http_thread.is_alive():
                    self._uvicorn.force_exit = True  # close the connections left open
                    self._http_thread.join(timeout=2.0)
        if self.service is not None and not self.service.wait_for_reload(max(0.5, remaining())):
            log.warning("a reload is still loading a checkpoint; exiting without waiting for it")
        return drained

    @property
    def reloading(self) -> bool:
        """A reload is still running (see :meth:`PredictionService.wait_for_reload`)."""
        return self.service is not None and self.service.reloading


#: Seconds before the watcher tries a version that failed to load again (then doubling).
RELOAD_RETRY_SECONDS = 5.0
RELOAD_RETRY_MAX_SECONDS = 300.0


#: Open files a server process needs besides its HTTP connections and gRPC calls: the model's
#: and checkpoint's files, listeners, pipes, the embedding tier's channels.
SPARE_OPEN_FILES = 256


def raise_open_files_limit(needed: int) -> str | None:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) to ``needed``, as far as
    its hard limit allows: containers often start at a soft 1024, which would fail accepts
    (EMFILE) before ``--max-connections`` answers anything. Returns a warning when the hard
    limit is lower than ``needed``, else None."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        return (
            f"open files are limited to {target} (hard RLIMIT_NOFILE), below the {needed} "
            "that --max-connections and --max-concurrent-rpcs may need: connections beyond "
            "it fail to be accepted instead of being answered 503 (raise the limit, or "
            "lower the caps)"
        )
    return None


class _StopDuringStartup(BaseException):
    """SIGTERM/SIGINT while the server was still starting (loading, waiting for its tier)."""


def serve(options: ServeOptions) -> int:
    """Run until SIGTERM/SIGINT; exit code 0 when drained cleanly.

    A signal during start-up (a checkpoint load, up to ``--startup-timeout`` waiting for the
    embedding tier) stops it there and exits 0, rather than after start-up ends: an
    orchestrator's kill timeout (30 s in deploy/k8s) is often shorter than the start-up."""
    if options.workers > 1:
        return serve_processes(options)
    if options.supervisor_pid is not None:  # one process of a --workers server
        stop_when_parent_exits(options.supervisor_pid, "the --workers supervisor")
    warning = raise_open_files_limit(
        options.max_connections + options.max_concurrent_rpcs + SPARE_OPEN_FILES
    )
    if warning:
        log.warning("%s", warning)
    server = PredictionServer(options)
    interrupted: list[str] = []

    def stop_starting(signum: int, _frame: FrameType | None) -> None:
        server.request_stop()
        if not interrupted:  # once: a second signal must not interrupt the stop itself
            interrupted.append(signal.Signals(signum).name)
            raise _StopDuringStartup(interrupted[0])

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_starting)
    try:
        try:
            server.start()
        finally:
            # A signal while these are replaced raises from here: the outer try catches it.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, server.request_stop)
    except _StopDuringStartup as stop:
        log.info("%s during start-up: stopping", stop)
        server.stop()
        return 0
    except BaseException:
        server.stop()
        raise
    if interrupted:  # the signal came as start() returned, after its last check
        log.info("%s during start-up: stopping", interrupted[0])
        server.stop()
        return 0
    server.wait()
    log.info("stopping: readiness off, draining for up to %.1f s", options.grace_seconds)
    drained = server.stop()
    if not drained:
        log.warning("grace period ended with requests still in flight")
    code = 0 if drained else 1
    if server.reloading:
        # Interpreter shutdown would end the reload's thread inside torch's native code,
        # which aborts the process (SIGABRT, "terminate called without an active
        # exception"): leave without it, the stop being done.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
