"""``recserve serve``: answer predictions for a checkpoint over HTTP and gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import re

from embedding_store.cli_types import (
    host_port_problem,
    non_empty,
    non_empty_path,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from embedding_store.errors import InvalidArgumentError
from embedding_store.tls_reload import DEFAULT_RELOAD_SECONDS
from serving.tls import server_tls, tls_flags_problem

log = logging.getLogger(__name__)


def onednn_min_rows(text: str) -> int | None:
    """``--onednn-min-rows``: ``auto`` (None: measured at load) or an integer >= 0."""
    if text.strip().lower() == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error}, or auto") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over HTTP and gRPC (KServe v2)",
        description="Load a checkpoint (dense TorchScript + embeddings) and answer predictions "
        "over HTTP (KServe v2 REST + a friendly JSON route) and gRPC (KServe v2).",
    )
    parser.add_argument(
        "--checkpoint", required=True, type=non_empty_path, help="checkpoint directory"
    )
    parser.add_argument("--model-name", default="model", help="name clients use (default model)")
    # Not empty: Python binds "" to every interface (HTTP), gRPC refuses it.
    parser.add_argument(
        "--host",
        type=non_empty,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1)",
    )
    parser.add_argument(
        "--http-port", type=port_number, default=8000, help="HTTP port (0: any free; default 8000)"
    )
    parser.add_argument(
        "--grpc-port", type=port_number, default=8001, help="gRPC port (0: any free; default 8001)"
    )
    parser.add_argument(
        "--embedding-workers",
        type=_address_list,
        default=None,
        help="HOST:PORT of the embedding worker (one; put a Service in front of several) "
        "(default: embedded, in-process)",
    )
    parser.add_argument(
        "--embedding-ps",
        type=_address_list,
        default=None,
        help="comma-separated parameter-server addresses in replica order: run the worker "
        "core in this process against them (one hop fewer than --embedding-workers)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=256,
        help="most samples merged into one lookup and model call (dynamic batching; a "
        "larger request runs alone) (default 256)",
    )
    parser.add_argument(
        "--max-request-batch-size",
        type=positive_int,
        default=4096,
        help="most samples one request may carry (400 / INVALID_ARGUMENT above it) (default 4096)",
    )
    parser.add_argument(
        "--max-queue-delay-ms",
        type=non_negative_float,
        default=2.0,
        help="how long the first request of a merged batch waits for others, in ms: longer "
        "merges larger batches (less CPU per request) at the cost of latency; 0 merges what "
        "arrives together (default 2; docs/BENCHMARKS.md, run Y)",
    )
    parser.add_argument(
        "--max-queue-size",
        type=positive_int,
        default=1024,
        help="requests waiting for a batch before new ones are refused (503 / UNAVAILABLE); "
        "one whose client went away or whose deadline passed frees its place at once "
        "(default 1024)",
    )
    parser.add_argument(
        "--request-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a request may take when its client sets no timeout of its own (the "
        "KServe 'timeout' parameter or a gRPC deadline replaces it, shorter or longer) "
        "(504 / DEADLINE_EXCEEDED after it; default 10)",
    )
    parser.add_argument(
        "--lookup-timeout",
        type=positive_float,
        default=5.0,
        help="seconds a lookup in a remote embedding tier may take before it fails, or falls "
        "back with --fallback-policy default (default 5)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=60.0,
        help="wait this long (s) for the remote embedding tier to serve: the "
        "--embedding-workers worker, or each --embedding-ps shard, and under "
        "--fallback-policy fail each shard's checkpoint loaded (default 60)",
    )
    parser.add_argument(
        "--fallback-policy",
        choices=["fail", "default"],
        default="fail",
        help="when lookups in a remote embedding tier (--embedding-workers, --embedding-ps) "
        "fail or time out: fail the request (the default), or use default vectors",
    )
    parser.add_argument(
        "--output-transform",
        choices=["identity", "sigmoid"],
        default="identity",
        help="applied to the dense model's output (sigmoid turns logits into probabilities; "
        "default identity)",
    )
    parser.add_argument(
        "--onednn-min-rows",
        type=onednn_min_rows,
        default=None,
        metavar="N|auto",
        help="merged batches of at least N rows run the dense model's linear layers as oneDNN "
        "kernels (prepacked weights, fused ReLU), once they match the model as loaded; auto "
        "(the default) times both models at load and picks 32, 64 or 128 where oneDNN is "
        "clearly faster on this CPU, else 256 (0: off)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=64 * 1024 * 1024,
        help="largest request: HTTP body (413 above it) or gRPC message (RESOURCE_EXHAUSTED) "
        "(default 64 MiB)",
    )
    parser.add_argument(
        "--max-decompressed-bytes",
        type=positive_int,
        default=8 * 1024 * 1024,
        help="largest HTTP body once its gzip/deflate Content-Encoding is undone (413 above "
        "it; inflated off the event loop, two at a time) (default 8 MiB)",
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open HTTP connections one server process holds at once; a connection beyond "
        "them is answered 503 and closed (per process of --workers; default "
        f"{DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-body-bytes-in-flight",
        type=positive_int,
        default=None,
        help="bytes of HTTP request bodies one server process reads at once, counted from "
        "Content-Length (a chunked body counts as --max-body-bytes) when its headers arrive; "
        "a request beyond them is answered 503 (at least --max-body-bytes; when not given, "
        "four times --max-body-bytes)",
    )
    parser.add_argument(
        "--max-concurrent-rpcs",
        type=positive_int,
        default=DEFAULT_MAX_CONCURRENT_RPCS,
        help="gRPC calls one server process holds at once, health checks included; a call "
        "beyond them is answered RESOURCE_EXHAUSTED (per process of --workers; default "
        f"{DEFAULT_MAX_CONCURRENT_RPCS})",
    )
    parser.add_argument(
        "--read-timeout-seconds",
        type=positive_float,
        default=60.0,
        help="an HTTP request must arrive within N seconds of its first byte (408 after it; "
        "an idle connection closes after 5 s, as uvicorn's keep-alive does; default 60)",
    )
    parser.add_argument(
        "--watch-seconds",
        type=non_negative_float,
        default=0.0,
        help="poll the checkpoint for a new version every N seconds (0: off, the default; "
        "else at least 0.1)",
    )
    parser.add_argument(
        "--reload-root",
        type=non_empty_path,
        default=None,
        help="POST /admin/reload loads only checkpoints under this directory (symlinks "
        "resolved; default: the directory that holds --checkpoint)",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--admin-token",
        default=None,
        help="bearer token for POST /admin/reload from non-loopback clients (visible in "
        "process lists: prefer --admin-token-file or the RECSERVE_ADMIN_TOKEN variable)",
    )
    token.add_argument(
        "--admin-token-file",
        type=non_empty_path,
        default=None,
        help="file holding the admin bearer token (e.g. a mounted Kubernetes Secret)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=non_negative_float,
        default=10.0,
        help="drain time on SIGTERM (s; default 10)",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="server processes sharing the ports (SO_REUSEPORT); each loads the model (default 1)",
    )
    parser.add_argument(
        "--tls-cert",
        type=non_empty_path,
        default=None,
        help="PEM certificate (chain) of the server: HTTPS and gRPC over TLS on both ports "
        "(with --tls-key)",
    )
    parser.add_argument(
        "--tls-key",
        type=non_empty_path,
        default=None,
        help="PEM private key of --tls-cert (unencrypted)",
    )
    parser.add_argument(
        "--tls-client-ca",
        type=non_empty_path,
        default=None,
        help="PEM CA certificate(s): require client certificates signed by it on both ports "
        "(mutual TLS)",
    )
    parser.add_argument(
        "--tls-reload-seconds",
        type=non_negative_float,
        default=DEFAULT_RELOAD_SECONDS,
        help="look at the --tls-* files for a renewal at most every N seconds, on a new "
        "connection; new connections get renewed files, open ones keep theirs; files that "
        f"fail to load leave the previous ones in use (0: read at start-up only; default "
        f"{DEFAULT_RELOAD_SECONDS:g})",
    )
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--supervisor-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--preprocessor",
        default=None,
        help="MODULE:FUNCTION turning friendly JSON instances (raw rows) into a Batch, e.g. "
        "examples.adult_income.preprocess:instances_to_batch; called once per request from "
        "several threads at once: it must be thread-safe",
    )
    parser.set_defaults(handler=_serve, parser=parser)


#: Defaults of --max-connections and --max-concurrent-rpcs: --max-queue-size's, so that the
#: queue (503 / UNAVAILABLE beyond it) is what a busy but honest load meets first.
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONCURRENT_RPCS = 1024
#: The most --max-connections: each holds a file descriptor, and the soft limit of open files
#: is rarely above this.
MAX_CONNECTIONS = 1 << 20
#: The largest --max-body-bytes / --max-decompressed-bytes: gRPC message limits are int32.
MAX_BODY_BYTES = 2**31 - 1
#: The most torch threads a process may ask for (beyond the cores they only contend).
MAX_THREADS = 1024
#: The most server processes (--workers): each loads the model, so beyond the cores they
#: only cost memory.
MAX_WORKERS = 256
#: The shortest checkpoint poll (--watch-seconds): each poll reads the checkpoint's marker
#: files, and a shorter interval only spins a core for nothing.
MIN_WATCH_SECONDS = 0.1
#: A model name: what clients put in /v2/models/NAME/...: no "/", whitespace or control
#: characters, so every route reaches it.
_MODEL_NAME = re.compile(r"[^\s/\x00-\x1f\x7f]{1,255}")
#: What an Authorization header can carry after "Bearer ": visible ASCII, no spaces.
_TOKEN = re.compile(r"[\x21-\x7e]+")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem of ``recserve serve``'s arguments taken together, or None."""
    if not _MODEL_NAME.fullmatch(args.model_name) or args.model_name in (".", ".."):
        return (
            f"--model-name {args.model_name!r}: a model name is 1 to 255 characters without "
            "'/', whitespace or control characters (clients put it in /v2/models/NAME/...)"
        )
    if args.http_port and args.http_port == args.grpc_port:
        return f"--http-port and --grpc-port are both {args.http_port}: give two ports"
    if args.max_queue_delay_ms / 1000.0 >= args.request_timeout:
        return (
            f"--max-queue-delay-ms {args.max_queue_delay_ms:g} is not below "
            f"--request-timeout {args.request_timeout:g} s: every request alone in the queue "
            "would time out before its batch runs"
        )
    for flag in ("max_body_bytes", "max_decompressed_bytes"):
        if getattr(args, flag) > MAX_BODY_BYTES:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)}: at most {MAX_BODY_BYTES}"
    if args.max_connections > MAX_CONNECTIONS:
        return f"--max-connections {args.max_connections}: at most {MAX_CONNECTIONS}"
    if args.max_concurrent_rpcs > MAX_BODY_BYTES:  # grpc takes an int32
        return f"--max-concurrent-rpcs {args.max_concurrent_rpcs}: at most {MAX_BODY_BYTES}"
    in_flight = args.max_body_bytes_in_flight
    if in_flight is not None and in_flight < args.max_body_bytes:
        return (
            f"--max-body-bytes-in-flight {in_flight} is below --max-body-bytes "
            f"{args.max_body_bytes}: the largest request allowed could never be read"
        )
    if args.threads > MAX_THREADS:
        return f"--threads {args.threads}: at most {MAX_THREADS}"
    if args.workers > MAX_WORKERS:
        return f"--workers {args.workers}: at most {MAX_WORKERS} (each process loads the model)"
    if 0 < args.watch_seconds < MIN_WATCH_SECONDS:
        return (
            f"--watch-seconds {args.watch_seconds:g}: 0 (off) or at least "
            f"{MIN_WATCH_SECONDS:g} s (each poll reads the checkpoint's files)"
        )
    if args.reload_root is not None and not args.reload_root.is_dir():
        return (
            f"--reload-root {args.reload_root}: no such directory (POST /admin/reload loads "
            "only checkpoints under it)"
        )
    workers = _addresses(args.embedding_workers or "")
    ps = _addresses(args.embedding_ps or "")
    for flag, addresses in (("--embedding-workers", workers), ("--embedding-ps", ps)):
        for index, address in enumerate(addresses):
            problem = host_port_problem(address)
            if problem:
                return f"{flag}: {problem}"
            if address in addresses[:index]:
                return f"{flag}: {address!r} is given twice"
    if workers and ps:
        return (
            "--embedding-workers and --embedding-ps both given: the server uses one tier, "
            "through a worker or straight to the shards"
        )
    if len(workers) > 1:
        return (
            f"--embedding-workers lists {len(workers)} addresses: a server talks to one "
            "embedding worker (put a Kubernetes Service in front of several)"
        )
    if args.admin_token is not None:
        problem = _token_problem(args.admin_token)
        if problem:
            return f"--admin-token {problem}"
    return tls_flags_problem(args.tls_cert, args.tls_key, args.tls_client_ca)


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _address_list(text: str) -> str:
    """The text of --embedding-workers / --embedding-ps: at least one address. Given ""
    (an unset shell variable), the server silently served from an embedded tier instead of
    the remote one it was pointed at; without the flag it is embedded, as documented."""
    if not _addresses(text):
        raise argparse.ArgumentTypeError(
            "give at least one HOST:PORT (leave the flag out for the embedded tier)"
        )
    return text


def _token_problem(token: str) -> str | None:
    """Why ``token`` cannot be an admin bearer token, or None."""
    if not token:
        return "is empty: an empty bearer token would let any client reload the model"
    if not _TOKEN.fullmatch(token):
        return (
            "has characters an Authorization header cannot carry (visible ASCII only: no "
            "spaces, control or non-ASCII characters)"
        )
    return None


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from --admin-token, --admin-token-file or RECSERVE_ADMIN_TOKEN."""
    from embedding_store.small_files import MAX_TOKEN_FILE_BYTES, read_small_file
    from serving.options import ADMIN_TOKEN_VARIABLE

    if args.admin_token is not None:
        return args.admin_token  # checked by check_arguments
    if args.admin_token_file is not None:
        source = f"--admin-token-file {args.admin_token_file}"
        try:
            raw = read_small_file(args.admin_token_file, source, "a token", MAX_TOKEN_FILE_BYTES)
            token = raw.decode("utf-8").strip()
        except OSError as error:
            raise InvalidArgumentError(f"{source}: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"{source}: not valid UTF-8 text") from None
    else:
        token = os.environ.get(ADMIN_TOKEN_VARIABLE, "").strip()
        if not token:
            return None  # no token: reloads from loopback clients only
        source = f"the {ADMIN_TOKEN_VARIABLE} variable"
    problem = _token_problem(token)
    if problem:
        raise InvalidArgumentError(f"{source}: the token {problem}")
    return token


def _serve(args: argparse.Namespace) -> int:
    from serving.options import ServeOptions

    problem = check_arguments(args)
    if problem:
        args.parser.error(problem)
    # Before anything binds or loads: a wrong file must not cost a model load to find.
    server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    workers = _addresses(args.embedding_workers or "")
    options = ServeOptions(
        checkpoint=args.checkpoint,
        model_name=args.model_name,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        embedding_workers=workers,
        embedding_ps=_addresses(args.embedding_ps or ""),
        max_batch_size=args.max_batch_size,
        max_request_batch_size=args.max_request_batch_size,
        max_queue_delay_ms=args.max_queue_delay_ms,
        max_queue_size=args.max_queue_size,
        request_timeout=args.request_timeout,
        lookup_timeout=args.lookup_timeout,
        startup_timeout=args.startup_timeout,
        fallback_policy=args.fallback_policy,
        output_transform=args.output_transform,
        onednn_min_rows=args.onednn_min_rows,
        max_body_bytes=args.max_body_bytes,
        max_decompressed_bytes=args.max_decompressed_bytes,
        read_timeout_seconds=args.read_timeout_seconds,
        max_connections=args.max_connections,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        watch_seconds=args.watch_seconds,
        admin_token=_admin_token(args),
        reload_root=args.reload_root,
        grace_seconds=args.grace_seconds,
        threads=args.threads,
        preprocessor=args.preprocessor,
        workers=args.workers,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tls_reload_seconds=args.tls_reload_seconds,
        reuse_port=args.reuse_port,
        supervisor_pid=args.supervisor_pid,
    )
    if not options.reuse_port:  # once, not again in each process of a --workers server
        for warning in options.unused_settings():
            log.warning("%s", warning)
    if options.workers > 1:  # the supervisor: it never loads torch or the model itself
        from serving.processes import serve_processes

        if options.preprocessor:
            # Imported once here, before any process starts (each imports it again for its
            # own use): a bad --preprocessor was reported once per process, N times over.
            from serving.preprocessor import load_preprocessor

            load_preprocessor(options.preprocessor)
        return serve_processes(options)
    from serving.server import serve

    return serve(options)
