"""The parameter-server process: one :class:`EmbeddingShard` behind the ``ParameterServer``
gRPC service, with health checking, server reflection, Prometheus metrics and graceful shutdown.

The servicer is :mod:`embedding_store.ps_service`, its metrics
:mod:`embedding_store.ps_metrics`. A training shard started with ``--load-checkpoint DIR``
loads its replica's part of that tier checkpoint in the background, taking the checkpoint's
optimizer and saved optimizer state when none is configured, and serves only once the load
finished; an inference shard loads ``infer_config.embedding_checkpoint`` the same way. On
SIGTERM/SIGINT the health service turns ``NOT_SERVING``, the server stops accepting RPCs (new
ones fail ``UNAVAILABLE``), in-flight RPCs get ``grace`` seconds to finish, the shard part is
optionally dumped, and the process exits 0.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from embedding_store import checkpoint_dump, checkpoint_publish
from embedding_store.checkpoint_manifest import DONE_MARKER, MANIFEST_NAME
from embedding_store.config import EmbeddingConfig, GlobalConfig, JobType
from embedding_store.errors import (
    AlreadyExistsError,
    CheckpointError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from embedding_store.gc_tuning import freeze_long_lived_objects, space_out_young_collections
from embedding_store.grpc_common import (
    LIVENESS_SERVICE,
    add_health_servicer,
    add_servicer,
    announce,
    bind_tier_port,
    format_address,
    server_interceptors,
    server_options,
    tier_tls,
)
from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.ps_service import SERVICE_NAME, ParameterServerServicer
from embedding_store.rpc_metrics import unauthenticated_counter
from embedding_store.shard import TRAINING_KERNELS, EmbeddingShard, warm_up_kernels

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParameterServerOptions:
    """How to run one parameter-server replica (the CLI flags)."""

    replica_index: int = 0
    replica_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    dump_on_exit: str | None = None
    #: Training shards: at start, load this replica's part of this embedding checkpoint.
    load_checkpoint: str | None = None
    #: Dump / Load RPCs take only directories under these (None: any, with a warning at
    #: start). The dump on exit and the load at start above are the operator's: not bound.
    dump_root: str | None = None
    load_root: str | None = None
    grace_seconds: float = 5.0
    max_workers: int = 16

    def __post_init__(self) -> None:
        if not (isinstance(self.replica_size, int) and self.replica_size >= 1):
            raise InvalidArgumentError(f"replica_size must be >= 1, got {self.replica_size!r}")
        if not (
            isinstance(self.replica_index, int) and 0 <= self.replica_index < self.replica_size
        ):
            raise InvalidArgumentError(
                f"replica_index must be in [0, {self.replica_size}), got {self.replica_index!r}"
            )
        if not self.host:
            raise InvalidArgumentError("host must be non-empty")
        if self.load_checkpoint is not None and not (
            isinstance(self.load_checkpoint, str) and self.load_checkpoint.strip()
        ):
            raise InvalidArgumentError(
                f"load_checkpoint must be a non-empty path, got {self.load_checkpoint!r}"
            )
        for name in ("dump_root", "load_root"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise InvalidArgumentError(f"{name} must be a non-empty path, got {value!r}")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
                raise InvalidArgumentError(f"{name} must be in 0..65535, got {value!r}")
        if not (math.isfinite(self.grace_seconds) and self.grace_seconds >= 0):
            raise InvalidArgumentError(f"grace_seconds must be >= 0, got {self.grace_seconds!r}")
        if self.max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be >= 1, got {self.max_workers!r}")


def build_shard(global_config: GlobalConfig, options: ParameterServerOptions) -> EmbeddingShard:
    """The shard of a replica: capacity from the global config, read-only for Infer jobs, no
    optimizer until Configure."""
    ps_config = global_config.embedding_parameter_server_config
    return EmbeddingShard(
        ps_config.capacity,
        read_only=global_config.common_config.job_type is JobType.INFER,
        replica_index=options.replica_index,
        replica_size=options.replica_size,
        num_hashmap_internal_shards=ps_config.num_hashmap_internal_shards,
    )


class ParameterServerProcess:
    """One parameter-server replica in this process: gRPC server, health, reflection, metrics.

    :meth:`start` binds and returns at once. A checkpoint to load at start (an inference
    shard's ``infer_config.embedding_checkpoint``, or a training shard's
    ``options.load_checkpoint``) loads in the background while the shard is NOT_SERVING; a
    failed load is kept in :attr:`fatal_error` and requests shutdown. :meth:`stop` shuts down
    gracefully. Use :func:`serve_parameter_server` to run one until SIGTERM/SIGINT.
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        global_config: GlobalConfig,
        options: ParameterServerOptions | None = None,
    ) -> None:
        self.embedding_config = embedding_config
        self.global_config = global_config
        self.options = options or ParameterServerOptions()
        self.job_type = global_config.common_config.job_type
        if self.options.load_checkpoint is not None and self.job_type is JobType.INFER:
            raise InvalidArgumentError(
                f"load_checkpoint ({self.options.load_checkpoint!r}) is for job_type Train; "
                "a job_type Infer shard loads common_config.infer_config.embedding_checkpoint"
            )
        self.shard = build_shard(global_config, self.options)
        self.metrics = ParameterServerMetrics(self.options.replica_index, self.options.replica_size)
        self.health = health.HealthServicer()
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.servicer = ParameterServerServicer(
            self.shard,
            embedding_config,
            job_type=self.job_type,
            metrics=self.metrics,
            health_servicer=self.health,
            dump_root=self.options.dump_root,
            load_root=self.options.load_root,
        )
        self.server: grpc.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.fatal_error: BaseException | None = None
        self.stop_requested = False  # set by signal handlers and fatal errors; no locks there
        self._metrics_httpd: WSGIServer | None = None
        self._stopped = False

    @property
    def name(self) -> str:
        return f"replica {self.options.replica_index}/{self.options.replica_size}"

    @property
    def address(self) -> str:
        if self.port is None:
            raise FailedPreconditionError("the parameter server is not started")
        return format_address(self.options.host, self.port)

    def start(self) -> None:
        opts = self.options
        tier_tls()  # bad RECSERVE_TIER_TLS_* fail here, before anything is made or bound
        for warning in self.root_warnings():
            log.warning("%s", warning)
        if opts.dump_on_exit:  # now, not when the rows are to be saved at exit
            self._check_dump_target(Path(opts.dump_on_exit).absolute())
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=opts.max_workers, thread_name_prefix="ps-rpc"),
            options=server_options(),
            interceptors=server_interceptors(unauthenticated_counter(self.metrics.errors)),
        )
        add_servicer(server, self.servicer, "ParameterServer")
        add_health_servicer(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        requested = format_address(opts.host, opts.port)
        self.port = bind_tier_port(server, requested)  # UnavailableError naming it
        self._start_metrics()
        # Before the server answers (health included): the first lookup, update or Configure
        # must not compile the shard's kernels (seconds on a busy machine, near a caller's
        # timeout). A training shard's optimizer is not known yet: every type's kernel.
        if self.shard.read_only:
            warm_up_kernels()
        else:
            warm_up_kernels(*TRAINING_KERNELS)
        directory, adopt_optimizer = self._checkpoint_at_start()
        if directory is not None:
            # Before the server answers anything: from its first RPC on, the shard reports
            # the load (NOT_SERVING, task "loading") and refuses lookups until it finished.
            self.servicer.expect_checkpoint()
        server.start()
        self.server = server
        log.info(
            "parameter server %s (%s, capacity %d rows) serving gRPC on %s",
            self.name,
            self.job_type.value,
            self.shard.capacity,
            self.address,
        )
        if directory is not None:
            self._start_load(directory, adopt_optimizer=adopt_optimizer)

    def root_warnings(self) -> list[str]:
        """What to warn about at start: a Dump or Load RPC that may name any directory
        (no ``--dump-root`` / ``--load-root``), or a root that is no directory (yet).
        Unrestricted stays the default so that existing setups (``embedding-tier dump DIR``
        anywhere) keep working; the deploy manifests set both roots to the checkpoint
        volume."""
        servicer = self.servicer
        warnings = []
        for flag, root, rpc, what, access in (
            ("--dump-root", servicer.dump_root, "Dump", "write into", "write"),
            ("--load-root", servicer.load_root, "Load", "read from", "read"),
        ):
            if root is None:
                warnings.append(
                    f"no {flag}: {rpc} RPCs {what} any directory this process's user can "
                    f"{access} (given by any peer that passes the tier token and network "
                    f"policy); set {flag} to the checkpoint volume"
                )
            elif not root.is_dir():
                warnings.append(
                    f"{flag} {root} is not a directory (yet; a typo?): {rpc} RPCs take "
                    "only directories under it all the same"
                )
        return warnings

    def _start_metrics(self) -> None:
        opts = self.options
        if opts.metrics_port is None:
            return
        if not self.global_config.common_config.metrics_config.enable_metrics:
            log.warning(
                "--metrics-port %d ignored: metrics_config.enable_metrics is false",
                opts.metrics_port,
            )
            return
        host = opts.host.strip("[]")
        try:
            httpd, _thread = start_http_server(
                opts.metrics_port, addr=host, registry=self.metrics.registry
            )
        except OSError as error:
            raise UnavailableError(
                f"cannot serve metrics on {format_address(opts.host, opts.metrics_port)}: {error}"
            ) from None
        self._metrics_httpd = httpd
        self.metrics_port = int(httpd.server_port)
        log.info("metrics on http://%s/metrics", format_address(opts.host, self.metrics_port))

    def _checkpoint_at_start(self) -> tuple[str | None, bool]:
        """The checkpoint to load at start (None: none) and whether to adopt its optimizer.

        Infer: ``infer_config.embedding_checkpoint`` (read-only rows, no optimizer state).
        Train: ``options.load_checkpoint``, with the checkpoint's optimizer and its saved state
        when none is configured yet (a restarted shard resumes where its dump left off).
        """
        if self.job_type is JobType.INFER:
            directory = self.global_config.common_config.infer_config.embedding_checkpoint
            if directory is None:
                log.warning(
                    "job_type Infer without infer_config.embedding_checkpoint: NOT_SERVING "
                    "until a Load RPC provides rows"
                )
            return directory, False
        ignored = self.global_config.common_config.infer_config.embedding_checkpoint
        if ignored is not None:
            # Set, but for Infer shards only: a config that forgot `job_type: Infer` served
            # a trainable shard of fresh random rows, without a word.
            log.warning(
                "infer_config.embedding_checkpoint %s is not loaded: job_type is %s, and only "
                "job_type Infer shards load it (a training shard loads --load-checkpoint)",
                ignored,
                self.job_type.value,
            )
        return self.options.load_checkpoint, True

    def _start_load(self, directory: str, *, adopt_optimizer: bool) -> None:
        """Run the load announced by ``expect_checkpoint`` on a thread; failure is fatal."""

        def load() -> None:
            try:
                self.servicer.load_checkpoint(
                    directory, expected=True, adopt_optimizer=adopt_optimizer
                )
            except BaseException as error:
                if isinstance(error, CheckpointError) and self.job_type is JobType.INFER:
                    # The directory came from the global config: name the key too.
                    error = CheckpointError(
                        f"common_config.infer_config.embedding_checkpoint: {error.message}"
                    )
                log.error("loading embedding checkpoint %s failed: %s", directory, error)
                self.fatal_error = error
                self.stop_requested = True

        threading.Thread(target=load, name="ps-checkpoint-load", daemon=True).start()

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, let in-flight RPCs finish (``grace`` s), dump if asked, close."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.options.grace_seconds if grace is None else grace
        self.servicer.begin_shutdown()
        if self.server is not None:
            self.server.stop(grace).wait()
        try:
            if self.options.dump_on_exit:
                self._dump_on_exit(self.options.dump_on_exit)
        finally:
            if self._metrics_httpd is not None:
                self._metrics_httpd.shutdown()
                self._metrics_httpd.server_close()
            log.info("parameter server %s stopped", self.name)

    def _dump_on_exit(self, directory: str) -> None:
        """Write this shard's part; a single replica's part is the whole checkpoint, so it also
        gets the manifest and done-marker and can be loaded as is.

        Nothing is written in place: a process killed mid-dump (its grace period over) must
        leave the previous dump whole. One replica: the checkpoint is written into a staging
        directory next to ``directory`` and renamed over it. Several: this replica's part is
        written into a staging directory and renamed over ``directory/shard_{index:05d}``.
        """
        target = Path(directory).absolute()
        running, _ = self.servicer.checkpoint_task_state()
        if running == "loading":
            # Stopped mid-load: the rows are (being) read from that checkpoint; a dump of a
            # half-loaded shard would be worth nothing.
            log.info("dump on exit skipped: a checkpoint load was still running")
            return
        if running:
            log.info(
                "waiting up to %.0f s for the running checkpoint dump to end before the "
                "dump on exit",
                EXIT_DUMP_WAIT_SECONDS,
            )
        if not self.shard.modified:
            # A shard restarted empty (or holding a checkpoint's rows as loaded) has nothing
            # to add, and writing it would replace the last copy of real rows with nothing.
            log.info(
                "dump on exit skipped: no row changed since this shard started or loaded a "
                "checkpoint (%d rows); %s is left as it is",
                self.shard.size(),
                target,
            )
            return
        self._check_dump_target(target)  # a checkpoint may have been written there since
        if self.options.replica_size == 1:
            staging = checkpoint_publish.staging_directory_for(target)
            try:
                entries = self.servicer.dump_part(str(staging), wait=EXIT_DUMP_WAIT_SECONDS)
                optimizer = self.shard.optimizer.to_dict() if self.shard.optimizer else None
                checkpoint_dump.finalize_checkpoint(
                    staging, self.embedding_config, 1, entries, optimizer
                )
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            checkpoint_publish.publish_directory(staging, target, overwrite=True)
            log.info("dump on exit published as %s", target)
            return
        part = target / checkpoint_dump.shard_part_name(self.options.replica_index)
        staging = checkpoint_publish.staging_directory_for(part)
        try:
            # Written as staging/shard_XXXXX, so only the rename below changes the name.
            self.servicer.dump_part(str(staging), wait=EXIT_DUMP_WAIT_SECONDS)
            checkpoint_publish.publish_directory(
                staging / part.name, part, overwrite=True, only_checkpoints=False
            )
            log.info("dump on exit published as %s", part)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _check_dump_target(self, target: Path) -> None:
        """AlreadyExistsError when the dump on exit into ``target`` would destroy a published
        checkpoint there. One shard of several renames its part over
        ``target/shard_{index:05d}``: inside a checkpoint, that changes files under its
        manifest, whose checksums every load then refuses. A single shard replaces the
        whole directory: an embedding checkpoint by a newer one, but never a checkpoint of
        another kind (a model checkpoint's dense model would be deleted with it)."""
        opts = self.options
        if not (target / DONE_MARKER).exists():
            return
        if opts.replica_size > 1:
            part = target / checkpoint_dump.shard_part_name(opts.replica_index)
            raise AlreadyExistsError(
                f"--dump-on-exit {target} is a published checkpoint (it has {DONE_MARKER}): "
                f"shard {opts.replica_index} of {opts.replica_size} would replace {part} under "
                "its manifest, and no load would take it any more; give --dump-on-exit a "
                "directory of its own"
            )
        if not (target / MANIFEST_NAME).exists():
            raise AlreadyExistsError(
                f"--dump-on-exit {target} holds a checkpoint that is not an embedding checkpoint "
                f"(it has {DONE_MARKER} but no {MANIFEST_NAME}: a model checkpoint?), which the "
                "dump on exit would replace whole; give --dump-on-exit a directory of its own"
            )


#: How long a stopping shard waits for a checkpoint dump still running (an admin's
#: ``embedding-tier dump`` that outlasted the grace period) before its own dump on exit.
EXIT_DUMP_WAIT_SECONDS = 120.0


def serve_parameter_server(
    embedding_config: EmbeddingConfig,
    global_config: GlobalConfig,
    options: ParameterServerOptions | None = None,
    *,
    install_signal_handlers: bool = True,
    on_started: Callable[[ParameterServerProcess], Any] | None = None,
) -> int:
    """Run one replica until SIGTERM/SIGINT (or a fatal startup error); returns the exit code.

    Prints ``parameter server replica I/N listening on HOST:PORT`` (flushed) once bound.
    A failed inference checkpoint load is re-raised after shutdown (the CLI exits 1).
    """
    process = ParameterServerProcess(embedding_config, global_config, options)

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        if process.stop_requested:
            return
        process.stop_requested = True
        log.info("received %s: shutting down", signal.Signals(signum).name)

    if install_signal_handlers:
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
    process.start()
    freeze_long_lived_objects()  # see embedding_store.gc_tuning: no ~100 ms full collections
    space_out_young_collections()
    try:
        if process.metrics_port is not None:
            announce(
                f"parameter server {process.name} metrics on "
                f"http://{format_address(process.options.host, process.metrics_port)}/metrics"
            )
        announce(f"parameter server {process.name} listening on {process.address}")
        if on_started is not None:
            on_started(process)
        while not process.stop_requested:
            time.sleep(0.1)
    finally:
        process.stop()
    if process.fatal_error is not None:
        raise process.fatal_error
    return 0
