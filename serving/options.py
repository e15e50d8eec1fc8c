"""``recserve serve``'s options: a frozen dataclass, light to import (no torch), so the
supervisor of a ``--workers`` server does not load what only its server processes need."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from embedding_store.tls_reload import DEFAULT_RELOAD_SECONDS

#: Environment variable read for the admin token when no flag gives one (and how
#: ``--workers`` hands it to its processes).
ADMIN_TOKEN_VARIABLE = "RECSERVE_ADMIN_TOKEN"
#: ``--max-body-bytes-in-flight`` when not given: this many bodies of ``--max-body-bytes``.
DEFAULT_BODIES_IN_FLIGHT = 4


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``recserve serve`` takes (see its --help)."""

    checkpoint: Path
    model_name: str = "model"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    embedding_workers: tuple[str, ...] = ()
    embedding_ps: tuple[str, ...] = ()  # shards in replica order; worker core in-process
    max_batch_size: int = 256
    max_request_batch_size: int = 4096
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 1024
    request_timeout: float = 10.0
    lookup_timeout: float = 5.0
    startup_timeout: float = 60.0  # how long a remote worker (or the shards) may take to serve
    fallback_policy: str = "fail"
    output_transform: str = "identity"
    # Merged batches this large run the oneDNN dense model (0: off; None: measured at load).
    onednn_min_rows: int | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    max_decompressed_bytes: int = 8 * 1024 * 1024  # a gzip/deflate body, inflated
    read_timeout_seconds: float = 60.0  # seconds a request may take to arrive, from its first byte
    # What one process holds at once (each bounds memory the others do not): open HTTP
    # connections (503 beyond), bytes of HTTP bodies being read (503 beyond; None: 4 x
    # max_body_bytes) and gRPC calls in progress (RESOURCE_EXHAUSTED beyond).
    max_connections: int = 1024
    max_body_bytes_in_flight: int | None = None
    max_concurrent_rpcs: int = 1024
    watch_seconds: float = 0.0  # poll the checkpoint for a new version (0: off)
    # A secret: out of repr, so a logged or printed ServeOptions never shows it.
    admin_token: str | None = field(default=None, repr=False)
    reload_root: Path | None = None  # POST /admin/reload loads only under it
    grace_seconds: float = 10.0
    threads: int = 1
    preprocessor: str | None = None  # "module:function" turning JSON instances into a Batch
    workers: int = 1  # server processes sharing the ports (SO_REUSEPORT)
    # TLS (HTTPS and gRPC SSL) when both are given; client certificates signed by the CA
    # are required on both ports when tls_client_ca is given too (mutual TLS).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Seconds between two looks (a stat, on a new handshake) at the TLS files for a renewal
    # (0: read at start-up only).
    tls_reload_seconds: float = DEFAULT_RELOAD_SECONDS
    # Set by a multi-process server for each of its processes: bind with SO_REUSEPORT, and
    # stop once the supervisor (this pid) is gone.
    reuse_port: bool = False
    supervisor_pid: int | None = None

    def body_bytes_in_flight(self) -> int:
        """``max_body_bytes_in_flight``, or its default: four bodies of ``max_body_bytes``."""
        if self.max_body_bytes_in_flight is not None:
            return self.max_body_bytes_in_flight
        return DEFAULT_BODIES_IN_FLIGHT * self.max_body_bytes

    def unused_settings(self) -> list[str]:
        """Warnings, one per setting changed from its default that has no effect with the
        others (named by their ``recserve serve`` flags): harmless, so logged at start-up
        rather than refused, but not silent (the server would run otherwise than asked)."""
        defaults = ServeOptions(checkpoint=self.checkpoint)
        unused = []
        if not self.embedding_workers and not self.embedding_ps:
            embedded = (
                "with the embedded tier (no --embedding-workers or --embedding-ps): its "
                "lookups run in this process and never time out"
            )
            if self.fallback_policy != defaults.fallback_policy:
                unused.append(f"--fallback-policy {self.fallback_policy} has no effect {embedded}")
            if self.lookup_timeout != defaults.lookup_timeout:
                unused.append(f"--lookup-timeout {self.lookup_timeout:g} has no effect {embedded}")
        if self.tls_cert is None and self.tls_reload_seconds != defaults.tls_reload_seconds:
            unused.append(
                f"--tls-reload-seconds {self.tls_reload_seconds:g} has no effect without "
                "--tls-cert and --tls-key: the server speaks plaintext"
            )
        return unused
