"""Shared gRPC plumbing of the embedding tier: packed arrays, options, error translation.

Arrays cross the wire as packed little-endian bytes (``bytes`` protobuf fields), never as
repeated scalars: packing is a memcpy, and decoding checks sizes before it trusts them.
Errors travel as status codes chosen by :mod:`embedding_store.errors` (one mapping, one place):
servers abort with the code of the raised error and its public message, and clients turn the
status back into the same error class, naming the peer that failed.
"""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from embedding_store.errors import (
    CheckpointError,
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
    error_for_grpc_code,
    grpc_code_name_of,
    public_message_of,
)
from embedding_store.renewing_channel import RenewingTierChannel
from embedding_store.small_files import MAX_TOKEN_FILE_BYTES, read_small_file
from embedding_store.tls import PemFile, check_key_pair, read_certificates, read_private_key
from embedding_store.tls_reload import (
    DEFAULT_RELOAD_SECONDS,
    ReloadingTls,
    dynamic_server_credentials,
)

log = logging.getLogger(__name__)

#: Health-check service name that reports SERVING for as long as the process serves gRPC at
#: all: for liveness probes. The overall service ("") is readiness: NOT_SERVING while a shard
#: loads, waits for its optimizer, or drains on SIGTERM, none of which a restart would fix.
LIVENESS_SERVICE = "recserve.liveness"
#: The embedding worker's gRPC service (also its readiness health-check name), here rather
#: than in :mod:`embedding_store.worker_service` so that its client imports no server (and no
#: torch through it).
WORKER_SERVICE = "recserve.embedding.v1.EmbeddingWorker"

#: Largest message either side accepts or sends; set explicitly on every channel and server.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Room a message keeps for everything but its row or slot values (names, shapes, framing):
#: an answer of more than MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES value bytes is refused.
MESSAGE_SLACK_BYTES = 64 * 1024

_U64 = np.dtype("<u8")
_F32 = np.dtype("<f4")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for client channels: explicit message limits, keepalive, fast reconnects."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 0),
    ]


#: Threads of a server's own, beside its RPC pool, that answer its health checks (and a
#: prediction server's liveness and readiness calls): see :func:`on_prompt_threads`.
PROMPT_THREADS = 2


def prompt_thread_pool() -> futures.ThreadPoolExecutor:
    """The pool of :data:`PROMPT_THREADS` threads for one server's :func:`on_prompt_threads`
    handlers (threads start on first use)."""
    return futures.ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="prompt")


def on_prompt_threads(behavior: F, pool: futures.ThreadPoolExecutor) -> F:
    """``behavior`` (a method handler's function: health Check, ServerLive, ...) run by
    ``pool`` instead of the server's RPC pool (grpcio's ``experimental_thread_pool``).

    A sync gRPC server runs every call on one pool, health checks included: when all its
    threads wait (lookups on a hung shard, up to their deadline; predictions on a slow
    tier), a probe waits behind them. A worker answered its liveness check after 9.5 s with
    12 lookups waiting on a stopped shard: probes (3 s timeouts) would have taken it out of
    its Service, then restarted it, for another pod's fault. Only calls that answer at once
    and never wait on a peer belong here."""

    @functools.wraps(behavior)
    def run(*args: Any, **kwargs: Any) -> Any:
        return behavior(*args, **kwargs)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def add_health_servicer(
    servicer: Any, server: grpc.Server, pool: futures.ThreadPoolExecutor | None = None
) -> None:
    """Register ``servicer`` (a ``grpc_health.v1.health.HealthServicer``) on ``server``, its
    Check calls answered by ``pool`` (default: a :func:`prompt_thread_pool` of its own),
    never queued behind the server's other calls (:func:`on_prompt_threads`). Watch, a
    stream held open, stays on the server's pool."""
    from grpc_health.v1 import health_pb2_grpc

    class _Prompt:
        def __init__(self) -> None:
            self.Check = on_prompt_threads(servicer.Check, pool or prompt_thread_pool())
            self.Watch = servicer.Watch

    health_pb2_grpc.add_HealthServicer_to_server(_Prompt(), server)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for servers: the same explicit message limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def announce(line: str) -> None:
    """Write ``line`` and its newline to stdout in one write, then flush. Launchers read a
    process's stdout and stderr from one file: ``print`` writes the text and the newline
    apart when stdout is unbuffered (``PYTHONUNBUFFERED``), and a log line written between
    them made ``listening on 127.0.0.1:37251`` read as port 372512026."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- a shared token
#: Environment variables with the embedding tier's shared token (the value, or a file that
#: holds it, e.g. a mounted Kubernetes Secret). Every tier process (parameter servers,
#: embedding workers, trainers' data receivers) then refuses calls without it, and every
#: tier client (workers, servers, trainers, data loaders, the CLI) sends it.
TOKEN_VARIABLE = "RECSERVE_TIER_TOKEN"
TOKEN_FILE_VARIABLE = "RECSERVE_TIER_TOKEN_FILE"
_TOKEN_KEY = "authorization"
#: Methods open without the token: health checks, for probes that cannot send metadata.
_OPEN_PREFIX = "/grpc.health.v1.Health/"


def tier_token() -> str | None:
    """The shared token from ``RECSERVE_TIER_TOKEN`` or the file ``RECSERVE_TIER_TOKEN_FILE``
    names, or None (no authentication: the tier's ports must then be reachable only by its
    own processes; docs/deploy.md, "Security"). InvalidArgumentError for an unreadable, empty
    or non-UTF-8 file, or one over 1 MiB (MAX_TOKEN_FILE_BYTES: the wrong file), and when
    both are set to different tokens (the variable won silently: a process given a rotated
    file kept the old token, and its peers refused it)."""
    token = os.environ.get(TOKEN_VARIABLE, "").strip()  # `echo` and --from-file add "\n"
    where = TOKEN_VARIABLE
    path = os.environ.get(TOKEN_FILE_VARIABLE)
    if path:
        from_file = _token_from_file(path)
        if token and from_file != token:
            raise InvalidArgumentError(
                f"{TOKEN_VARIABLE} and {TOKEN_FILE_VARIABLE}={path} are both set, to different "
                "tokens: set only one"
            )
        token, where = from_file, f"{TOKEN_FILE_VARIABLE}={path}"
    if not token:
        return None
    # It travels in a header: printable ASCII only, or every call fails with an opaque
    # "Invalid metadata".
    if not (token.isascii() and token.isprintable()):
        raise InvalidArgumentError(
            f"{where}: the tier token must be printable ASCII (no control characters)"
        )
    return token


def _token_from_file(path: str) -> str:
    """The token in the file ``path`` (stripped); InvalidArgumentError as :func:`tier_token`
    says."""
    where = f"{TOKEN_FILE_VARIABLE}={path}"
    try:
        raw = read_small_file(path, where, "a token", MAX_TOKEN_FILE_BYTES)
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{where}: not valid UTF-8 text") from None
    except OSError as error:
        raise InvalidArgumentError(f"{where}: {error.strerror or error}") from None
    if not token:
        raise InvalidArgumentError(f"{where} is empty")
    return token


class _RequireToken(grpc.ServerInterceptor):
    """Refuses every call but health checks unless its metadata has ``authorization:
    Bearer <token>`` (compared in constant time); ``on_refused(method)`` is told of each
    refusal (the method's name, e.g. ``Lookup``: one of the server's, never the caller's
    made-up one, which gRPC answers UNIMPLEMENTED before this)."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"this embedding tier needs its token ({TOKEN_VARIABLE} or "
                f"{TOKEN_FILE_VARIABLE}); the call had none or another",
            )

        # Request-streaming handlers even for unary requests: the refusal never reads the
        # request, so a caller without the token cannot make the server buffer up to the
        # message limit (256 MiB) per call; a unary handler would read it all first.
        self._refusals = {
            (False, False): grpc.stream_unary_rpc_method_handler(refuse),
            (False, True): grpc.stream_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse),
        }

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIX):
            return handler
        sent = next(
            (
                value
                for key, value in handler_call_details.invocation_metadata or ()
                if key == _TOKEN_KEY
            ),
            "",
        )
        sent_bytes = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        if self._on_refused is not None:
            try:
                self._on_refused(handler_call_details.method.rpartition("/")[2])
            except Exception:  # counting must not turn a refusal into a failed interceptor
                log.exception("counting a call refused for its token failed")
        return self._refusals[(handler.request_streaming, handler.response_streaming)]


def server_interceptors(
    on_refused: Callable[[str], None] | None = None,
) -> list[grpc.ServerInterceptor]:
    """For ``grpc.server(..., interceptors=...)`` of a tier service: the token check when
    :func:`tier_token` gives one, else nothing. ``on_refused(method)`` is told of every call
    refused for its token (UNAUTHENTICATED): the methods never see those calls, so their
    error counters (``rpc_errors_total``) would not either."""
    token = tier_token()
    return [_RequireToken(token, on_refused)] if token else []


class _SendToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._metadata = (_TOKEN_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._metadata]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details with the token added (grpc gives no public constructor)."""


# --------------------------------------------------------------------------- mutual TLS
#: Environment variables with the embedding tier's TLS files (PEM paths, e.g. a mounted
#: Kubernetes Secret written by cert-manager: tls.crt, tls.key, ca.crt). All three set: every
#: tier server requires TLS with a client certificate signed by the CA, and every tier client
#: presents its certificate and verifies the server's against the same CA (mutual TLS). None
#: set: plaintext. Anything in between is an error.
TLS_CERT_VARIABLE = "RECSERVE_TIER_TLS_CERT"
TLS_KEY_VARIABLE = "RECSERVE_TIER_TLS_KEY"
TLS_CA_VARIABLE = "RECSERVE_TIER_TLS_CA"
TLS_VARIABLES = (TLS_CERT_VARIABLE, TLS_KEY_VARIABLE, TLS_CA_VARIABLE)


@dataclass(frozen=True)
class TierTls:
    """The tier's certificate chain and key (each process presents them, as a server and as
    a client) and the CA that signed every certificate of the tier."""

    cert: PemFile
    key: PemFile
    ca: PemFile

    def server_credentials(self) -> grpc.ServerCredentials:
        """Client certificates required, signed by the tier's CA."""
        return grpc.ssl_server_credentials(
            [(self.key.data, self.cert.data)],
            root_certificates=self.ca.data,
            require_client_auth=True,
        )

    def certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        """What dynamic server credentials take: the same key, chain and CA."""
        return grpc.ssl_server_certificate_configuration(
            [(self.key.data, self.cert.data)], root_certificates=self.ca.data
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The server's certificate checked against the tier's CA; ours presented."""
        return grpc.ssl_channel_credentials(self.ca.data, self.key.data, self.cert.data)


#: Seconds between two looks at the tier's TLS files for a renewal (a stat each, on a new
#: handshake or a new channel; default DEFAULT_RELOAD_SECONDS; 0: read at start only).
TLS_RELOAD_VARIABLE = "RECSERVE_TIER_TLS_RELOAD_SECONDS"

#: The files per (cert, key, ca) paths and interval: read and checked once per process, then
#: again only when they change (embedding_store.tls_reload), not per channel.
_TLS_CACHE: dict[tuple[str, str, str, float], ReloadingTls[TierTls]] = {}
_TLS_LOCK = threading.Lock()


def _tls_paths() -> dict[str, str]:
    """The TLS variables that are set (non-empty), by name."""
    return {name: value for name in TLS_VARIABLES if (value := os.environ.get(name, "").strip())}


def _tls_reload_seconds() -> float:
    text = os.environ.get(TLS_RELOAD_VARIABLE, "").strip()
    if not text:
        return DEFAULT_RELOAD_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(
            f"{TLS_RELOAD_VARIABLE}={text}: must be a number of seconds >= 0 (0: read the "
            "TLS files at start only)"
        )
    return seconds


def _load_tier_tls(cert_path: str, key_path: str, ca_path: str) -> TierTls:
    try:
        cert = read_certificates(TLS_CERT_VARIABLE, cert_path)
        private_key = read_private_key(TLS_KEY_VARIABLE, key_path)
        ca = read_certificates(TLS_CA_VARIABLE, ca_path)
        check_key_pair(cert, private_key)
    except InvalidArgumentError as error:
        raise ConfigError(error.message) from None
    return TierTls(cert, private_key, ca)


def tier_tls_files() -> ReloadingTls[TierTls] | None:
    """The tier's TLS files as :func:`tier_tls` finds them, reloaded when they change (at
    most every ``RECSERVE_TIER_TLS_RELOAD_SECONDS``); None for plaintext. ConfigError as
    :func:`tier_tls` says, the first time only: a renewal that fails to load later leaves
    the previous files in use, with a warning (embedding_store.tls_reload)."""
    given = _tls_paths()
    if not given:
        return None
    missing = [name for name in TLS_VARIABLES if name not in given]
    if missing:
        raise ConfigError(
            f"{' and '.join(given)} set without {' and '.join(missing)}: the embedding tier's "
            f"mutual TLS needs all three of {', '.join(TLS_VARIABLES)} (or none, for plaintext)"
        )
    paths = (given[TLS_CERT_VARIABLE], given[TLS_KEY_VARIABLE], given[TLS_CA_VARIABLE])
    interval = _tls_reload_seconds()
    with _TLS_LOCK:
        files = _TLS_CACHE.get((*paths, interval))
        if files is None:
            files = _TLS_CACHE[(*paths, interval)] = ReloadingTls(
                [Path(path) for path in paths],
                functools.partial(_load_tier_tls, *paths),
                interval=interval,
                what="the embedding tier's " + "/".join(TLS_VARIABLES),
            )
        return files


def tier_tls() -> TierTls | None:
    """The tier's TLS files from ``RECSERVE_TIER_TLS_CERT``, ``RECSERVE_TIER_TLS_KEY`` and
    ``RECSERVE_TIER_TLS_CA``, or None when none is set (plaintext). ConfigError, naming the
    variable and the file, when only some are set or a file is missing, not PEM, an
    encrypted key, or a key that does not match the certificate. Read once per process (per
    set of paths): call it at start-up; later calls cost a dictionary lookup, and every
    ``RECSERVE_TIER_TLS_RELOAD_SECONDS`` a stat of each file, which reads them again when
    they changed (renewed in place): new channels then use the renewed files."""
    files = tier_tls_files()
    return None if files is None else files.check()[1]


def reset_tier_tls_cache() -> None:
    """Forget the files read by :func:`tier_tls` (tests)."""
    with _TLS_LOCK:
        _TLS_CACHE.clear()


def bind_tier_port(server: grpc.Server, address: str) -> int:
    """``server.add_secure_port`` with the tier's mutual TLS when :func:`tier_tls` gives
    it, else ``add_insecure_port`` (today's plaintext). Returns the port bound (> 0).
    ConfigError for bad TLS variables, before anything is bound; UnavailableError naming
    ``address`` when it cannot be bound (grpcio raises a bare RuntimeError, older ones
    returned 0). Under TLS, new handshakes get renewed files (:func:`tier_tls_files`); open
    connections keep theirs."""
    files = tier_tls_files()
    try:
        if files is None:
            bound = server.add_insecure_port(address)
        else:
            credentials = dynamic_server_credentials(
                files, TierTls.certificate_configuration, require_client_auth=True
            )
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # "Failed to bind to address ...": the cause is only in gRPC's log
        bound = 0
    if not bound:
        raise UnavailableError(
            f"cannot listen on {address}: the port is in use, or the host is not an address "
            "of this machine (port 0 picks a free port)"
        )
    return bound


def tier_transport() -> str:
    """For start-up lines: ``"mutual TLS"`` or ``"plaintext"``."""
    return "mutual TLS" if tier_tls() is not None else "plaintext"


def _token_wrapper(token: str | None) -> Callable[[grpc.Channel], grpc.Channel] | None:
    """What sends ``token`` on every call of a channel (None: no token, nothing to add)."""
    if not token:
        return None
    return lambda channel: grpc.intercept_channel(channel, _SendToken(token))


def tier_channel(
    address: str,
    options: list[tuple[str, Any]] | None = None,
    *,
    retry_safe: Collection[str] = (),
) -> grpc.Channel:
    """A channel to a tier service at ``address``: mutual TLS when the RECSERVE_TIER_TLS_*
    variables are set (:func:`tier_tls`; ConfigError for bad ones, now rather than at the
    first call), else insecure; with the shared token on every call when one is set.

    Under TLS with renewals looked for (``RECSERVE_TIER_TLS_RELOAD_SECONDS`` > 0), a
    :class:`RenewingTierChannel`: it follows renewed files, so a long-lived channel presents
    the current certificate when it reconnects. ``retry_safe``: full method names
    (``/package.Service/Method``) that may be sent twice, retried once there when a call
    fails UNAVAILABLE on a channel the renewal replaced. Plaintext, or TLS read at start
    only: a plain gRPC channel, as before (nothing added per call)."""
    files = tier_tls_files()
    options = options or channel_options()
    token = tier_token()
    if files is not None and files.interval > 0:
        return RenewingTierChannel(
            address, options, files, _token_wrapper(token), frozenset(retry_safe)
        )
    if files is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(
            address, files.check()[1].channel_credentials(), options=options
        )
    return grpc.intercept_channel(channel, _SendToken(token)) if token else channel


def tls_hint(details: str) -> str:
    """What to check when a tier call failed with ``details`` that read like a TLS failure
    ("" otherwise), for the RECSERVE_TIER_TLS_* variables of this process or its peer."""
    lowered = details.lower()
    secure = bool(_tls_paths())
    if "certificate_verify_failed" in lowered or "certificate verify failed" in lowered:
        return (
            f" (TLS: the peer's certificate is not signed by the CA in {TLS_CA_VARIABLE}, "
            "or does not name the address dialled)"
        )
    if "wrong_version_number" in lowered or "wrong version number" in lowered:
        return (
            " (TLS: the peer answered in plaintext: set RECSERVE_TIER_TLS_CERT, _KEY and _CA "
            "for every tier process, or for none)"
        )
    handshake_ended = any(
        sign in lowered
        for sign in (
            "socket closed",
            "unknown ca",
            "unknown_ca",
            "certificate required",
            "certificate_required",
            "bad certificate",
            "bad_certificate",
            "handshake",
        )
    )
    if not handshake_ended:
        return ""
    if secure:
        return (
            f" (TLS: the peer ended the handshake: is this process's {TLS_CERT_VARIABLE} "
            "signed by the CA the peer trusts?)"
        )
    return " (if the embedding tier uses TLS, set RECSERVE_TIER_TLS_CERT, _KEY and _CA here too)"


#: What gRPC's transport says when the peer answered its HTTP/2 preface in HTTP/1.x (an
#: HTTP server: a prediction server's --http-port, say); the wording of grpcio's versions.
_HTTP1_SIGNS = ("expected settings frame", "http1.x server")


def answered_in_http1(details: str) -> bool:
    """Whether a failed call's ``details`` say the peer speaks HTTP/1.x, not gRPC: waiting
    for it would not change that."""
    lowered = details.lower()
    return any(sign in lowered for sign in _HTTP1_SIGNS)


def http1_message(peer: str) -> str:
    """The error for a ``peer`` that answered in HTTP/1.x (:func:`answered_in_http1`)."""
    return (
        f"{peer} answered in HTTP/1.x, not gRPC: is that an HTTP port (a prediction server's "
        "--http-port)? Parameter-server shards, embedding workers and prediction servers "
        "each listen on ports of their own; give the gRPC one"
    )


# --------------------------------------------------------------------------- packed arrays
def pack_u64(values: np.ndarray) -> bytes:
    """uint64 [n] -> little-endian bytes."""
    return np.ascontiguousarray(values, dtype=_U64).tobytes()


def pack_f32(values: np.ndarray) -> bytes:
    """float32 array of any shape -> little-endian bytes (row-major)."""
    return np.ascontiguousarray(values, dtype=_F32).tobytes()


def unpack_u64(payload: bytes, field: str) -> np.ndarray:
    """Little-endian bytes -> uint64 [n]; InvalidArgumentError naming ``field`` if malformed."""
    if len(payload) % 8:
        raise InvalidArgumentError(
            f"{field}: {len(payload)} bytes is not a whole number of uint64 values"
        )
    return np.frombuffer(payload, dtype=_U64).astype(np.uint64, copy=False)


def unpack_f32(payload: bytes, shape: tuple[int, ...], field: str) -> np.ndarray:
    """Little-endian bytes -> float32 ``shape``; InvalidArgumentError naming ``field``."""
    expected = 4 * int(np.prod(shape, dtype=np.int64))
    if len(payload) != expected:
        raise InvalidArgumentError(
            f"{field}: got {len(payload)} bytes, expected {expected} for float32 {list(shape)}"
        )
    return np.frombuffer(payload, dtype=_F32).astype(np.float32, copy=False).reshape(shape)


# --------------------------------------------------------------------------- server side
def status_code_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code of any exception (recserve errors by class, others INTERNAL)."""
    return grpc.StatusCode[grpc_code_name_of(error)]


F = TypeVar("F", bound=Callable[..., Any])


def parse_request(
    request_class: type[Message],
    payload: bytes,
    context: grpc.ServicerContext,
    on_malformed: Callable[[InvalidArgumentError], None] | None = None,
) -> Any:
    """``payload`` parsed as ``request_class``; aborts INVALID_ARGUMENT naming the message if
    it is malformed, after telling ``on_malformed`` (which counts it: the call never reaches
    the method whose decorators count failures). Services parse in their handlers, not in
    gRPC's deserializer, because gRPC answers INTERNAL when a deserializer fails: a client's
    garbage is the client's error."""
    try:
        return request_class.FromString(payload)
    except DecodeError as error:
        problem = InvalidArgumentError(f"malformed {request_class.__name__}: {error}")
        if on_malformed is not None:
            on_malformed(problem)
        context.abort(status_code_of(problem), public_message_of(problem))


def _parsed_stream(request_class: type[Message], payloads: Iterator[bytes]) -> Iterator[Any]:
    for payload in payloads:
        try:
            yield request_class.FromString(payload)
        except DecodeError as error:  # the servicer's rpc_errors answers INVALID_ARGUMENT
            raise InvalidArgumentError(f"malformed {request_class.__name__}: {error}") from None


Implementation = Callable[[Any, grpc.ServicerContext], Any]


def _error_counter(errors: Any, method: str) -> Callable[[InvalidArgumentError], None]:
    """Counts a malformed request of ``method`` in ``errors`` (a Counter by method, code)."""
    child = errors.labels(method, grpc_code_name_of(InvalidArgumentError("")))
    return lambda _problem: child.inc()


def _parsing_handler(
    call: Implementation,
    request_class: type[Message],
    *,
    streamed: bool,
    on_malformed: Callable[[InvalidArgumentError], None] | None = None,
) -> Implementation:
    """``call`` taking raw request bytes (or, ``streamed``, an iterator of them).
    ``on_malformed`` is told of a unary request that does not parse (a malformed message of
    a stream fails inside ``call``, which counts it)."""
    if streamed:

        def parse_each(payloads: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            return call(_parsed_stream(request_class, payloads), context)

        return parse_each

    def parse_one(payload: bytes, context: grpc.ServicerContext) -> Any:
        return call(parse_request(request_class, payload, context, on_malformed), context)

    return parse_one


def add_servicer(server: grpc.Server, servicer: object, service_name: str) -> None:
    """Register ``servicer`` for ``service_name`` of embedding_tier.proto (``ParameterServer``,
    ``EmbeddingWorker``), as the generated ``add_*_to_server`` does, but with requests parsed
    by :func:`parse_request` in the handlers."""
    from embedding_store.proto import embedding_tier_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name[service_name]
    # A servicer with RPC metrics (embedding_store.rpc_metrics) counts the failures of its
    # methods there; a unary request that does not parse never reaches them, so it is
    # counted here (rpc_errors_total{code="INVALID_ARGUMENT"}, not timed).
    errors = getattr(getattr(servicer, "metrics", None), "errors", None)
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        if method.client_streaming:
            factory = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming:
            factory = grpc.unary_stream_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        handler = _parsing_handler(
            getattr(servicer, method.name),
            request_class,
            streamed=method.client_streaming,
            on_malformed=None if errors is None else _error_counter(errors, method.name),
        )
        handlers[method.name] = factory(
            handler, response_serializer=response_class.SerializeToString
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def rpc_errors(method: F) -> F:
    """Decorate a unary servicer method: recserve errors abort with their code and message;
    anything else is logged with its traceback and answered INTERNAL without details."""

    @functools.wraps(method)
    def wrapper(self: object, request: Message, context: grpc.ServicerContext) -> Message:
        try:
            return method(self, request, context)
        except RecserveError as error:
            context.abort(status_code_of(error), public_message_of(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, public_message_of(error))

    return wrapper  # type: ignore[return-value]


def rpc_stream_errors(method: F) -> F:
    """Like :func:`rpc_errors` for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self: object, request: Message, context: grpc.ServicerContext) -> Iterator[Message]:
        try:
            yield from method(self, request, context)
        except RecserveError as error:
            context.abort(status_code_of(error), public_message_of(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, public_message_of(error))

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- client side
def error_from_rpc(error: grpc.RpcError, peer: str) -> RecserveError:
    """Turn a failed call into the recserve error of its status, naming ``peer``.

    ``peer`` describes who failed, e.g. ``"parameter server 127.0.0.1:7001 (shard 1 of 2)"``.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        if answered_in_http1(details):
            return UnavailableError(f"{http1_message(peer)} ({details})")
        return UnavailableError(f"{peer} is unavailable: {details}{tls_hint(details)}")
    if code == grpc.StatusCode.CANCELLED:
        # Retryable, like UNAVAILABLE; the message says who cancelled it (grpcio's details
        # tell this process's own cancels from the peer's), never guessing at a shutdown.
        return UnavailableError(_cancelled_message(peer, details))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"{peer} did not answer within the deadline: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION and "checkpoint" in details.lower():
        return CheckpointError(f"{peer}: {details}")
    if code == grpc.StatusCode.UNIMPLEMENTED and details == _NO_SUCH_METHOD:
        # gRPC's own answer for a service the process does not run: the address is another
        # kind of process (a shard's port given as a worker's, a prediction server's).
        return error_for_grpc_code(
            code.name,
            f"{peer}: the process at that address answers gRPC but not this call ({details}); "
            "is the address right? Parameter-server shards, embedding workers and prediction "
            "servers each listen on ports of their own",
        )
    return error_for_grpc_code(code.name, f"{peer}: {details}")


#: grpcio's details of a call that this process ended itself: its channel was closed while the
#: call was in flight (a reload closing a replaced model's tier, a client closed), or the call
#: was cancelled (a streaming call whose caller gave up).
_CLOSED_HERE = "Channel closed!"
_CANCELLED_HERE = "Locally cancelled by application!"


def _cancelled_message(peer: str, details: str) -> str:
    """What a CANCELLED call from ``peer`` was: ended by this process or by the other side."""
    if details == _CLOSED_HERE:
        return (
            f"call to {peer} cancelled by this process: its channel was closed while the call "
            f"was in flight ({details})"
        )
    if details == _CANCELLED_HERE:
        return f"call to {peer} cancelled by this process: its caller gave up ({details})"
    return (
        f"{peer} cancelled the call (the server, or a proxy between, ended it before "
        f"answering): {details}"
    )


#: The details of gRPC's UNIMPLEMENTED for a method no handler serves (grpcio's server).
_NO_SUCH_METHOD = "Method not found!"


def call(peer: str, method: Callable[..., Any], request: Any, *, timeout: float | None) -> Any:
    """Invoke a unary ``method`` with a deadline; failures become recserve errors."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as error:
        raise error_from_rpc(error, peer) from None


#: First pause between attempts of :func:`call_with_retries` (doubling up to the maximum).
RETRY_FIRST_PAUSE_SECONDS = 0.1
RETRY_MAX_PAUSE_SECONDS = 1.0
#: What gRPC answers when it found no connection to send a call on (the peer refused it, is
#: down or unreachable): the call never left this process.
_NOT_SENT = "failed to connect to all addresses"


def never_sent(error: grpc.RpcError) -> bool:
    """Whether a failed call is known not to have reached its server: gRPC had no connection
    to send it on. Such a call may be sent again whatever it does (a gradient push too);
    one that failed in flight ("Socket closed", "Stream removed") may have been applied."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or ""
    # gRPC's own words start the details; a peer's answer may quote them further on (a
    # worker's report of pushes lost to a shard it could not reach), and was sent.
    return code == grpc.StatusCode.UNAVAILABLE and details.startswith(_NOT_SENT)


def call_with_retries(
    peer: str,
    method: Callable[..., Any],
    request: Any,
    *,
    timeout: float | None,
    retry_seconds: float,
    resend: bool,
    not_applied: Callable[[grpc.RpcError], bool] | None = None,
) -> Any:
    """:func:`call`, sent again with backoff while its peer is unreachable, for up to
    ``retry_seconds`` (a peer restarting, a network blip) before the error is raised, naming
    the peer and the attempts.

    ``resend=True`` (reads, and calls that are the same sent twice): any UNAVAILABLE or
    CANCELLED (a stopping server) is retried. ``resend=False`` (gradient pushes, a flush whose
    answer reports lost pushes as UNAVAILABLE): only calls that were never sent
    (:func:`never_sent`), or whose answer ``not_applied`` knows to be given before anything
    was done. Each attempt has its own ``timeout``; a deadline is never retried (the peer may
    still be at work on it)."""
    start = time.monotonic()
    pause = RETRY_FIRST_PAUSE_SECONDS
    attempts = 0
    while True:
        attempts += 1
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            retryable = (
                never_sent(error)
                or (resend and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED))
                or (not_applied is not None and not_applied(error))
            )
            elapsed = time.monotonic() - start
            if not retryable or elapsed + pause > retry_seconds:
                failure = error_from_rpc(error, peer)
                if attempts > 1:
                    failure = type(failure)(
                        f"{failure.message} (gave up after {attempts} attempts over "
                        f"{elapsed:.1f} s)"
                    )
                raise failure from None
            if attempts == 1:
                log.warning(
                    "%s failed (%s): trying again for up to %g s",
                    peer,
                    (error.details() if hasattr(error, "details") else None) or code.name,
                    retry_seconds,
                )
            time.sleep(pause)
            pause = min(2 * pause, RETRY_MAX_PAUSE_SECONDS)
