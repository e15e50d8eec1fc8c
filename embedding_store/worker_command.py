"""``recserve embedding-worker``: route batches to parameter-server shards over gRPC."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from embedding_store.cli_types import (
    grpc_address,
    host_port_addresses,
    non_empty,
    non_negative_float,
    path_text,
    port_number,
    positive_float,
)
from embedding_store.config import load_embedding_config, load_global_config

if TYPE_CHECKING:  # the tier imports torch: ~1 s that every `recserve` command would pay
    from embedding_store.tier import TierStatus

log = logging.getLogger(__name__)


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in host_port_addresses(text).split(",") if a.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "embedding-worker",
        help="run an embedding worker over parameter-server shards",
        description="Route batches to parameter-server shards (given by address, in replica "
        "order), pool embeddings, and push gradients asynchronously.",
    )
    parser.add_argument(
        "--ps",
        type=_addresses,
        default=None,
        help="comma-separated HOST:PORT of the shards, replica 0 first "
        "(default: infer_config.servers of the global config)",
    )
    parser.add_argument(
        "--port", type=port_number, default=0, help="gRPC port (0: any free port, the default)"
    )
    parser.add_argument(
        "--host",
        type=non_empty,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="M",
        help="serve Prometheus metrics on http://HOST:M/metrics (0: pick a free port; "
        "absent: no metrics)",
    )
    parser.add_argument(
        "--embedding-config",
        type=path_text,
        default=None,
        help="embedding_config.yml (default: $RECSERVE_EMBEDDING_CONFIG)",
    )
    parser.add_argument(
        "--global-config",
        type=path_text,
        default=None,
        help="global_config.yml (default: $RECSERVE_GLOBAL_CONFIG, else all defaults)",
    )
    # Checked types: a NaN or negative value would wait forever, or not at all.
    parser.add_argument(
        "--shard-timeout",
        type=positive_float,
        default=10.0,
        help="deadline of each shard call (s; default 10)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=non_negative_float,
        default=60.0,
        help="wait this long for the shards (s; default 60)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=non_negative_float,
        default=5.0,
        help="drain time on SIGTERM (s; default 5)",
    )
    parser.set_defaults(handler=_run)
    register_admin(subparsers)


def _run(args: argparse.Namespace) -> int:
    from embedding_store.worker_service import serve_embedding_worker

    if args.metrics_port and args.metrics_port == args.port:
        raise SystemExit(
            f"recserve embedding-worker: error: --metrics-port must differ from --port, "
            f"both are {args.port}"
        )
    embedding_config = load_embedding_config(args.embedding_config)
    global_config = load_global_config(args.global_config)
    shards = args.ps or list(global_config.common_config.infer_config.servers)
    if not shards:
        raise SystemExit(
            "recserve embedding-worker: error: no shards: pass --ps HOST:PORT[,HOST:PORT...] "
            "or set common_config.infer_config.servers in the global config"
        )
    metrics_port = args.metrics_port
    if metrics_port is not None and not global_config.common_config.metrics_config.enable_metrics:
        log.warning(
            "--metrics-port %d ignored: metrics_config.enable_metrics is false", metrics_port
        )
        metrics_port = None
    return serve_embedding_worker(
        embedding_config,
        shards,
        host=args.host,
        port=args.port,
        metrics_port=metrics_port,
        forward_buffer_size=global_config.embedding_worker_config.forward_buffer_size,
        shard_timeout=args.shard_timeout,
        startup_timeout=args.startup_timeout,
        grace_seconds=args.grace_seconds,
    )


# --------------------------------------------------------------------------- tier administration
def register_admin(subparsers: argparse._SubParsersAction) -> None:
    """``recserve embedding-tier dump|load|status|clear --worker ADDR``."""
    parser = subparsers.add_parser(
        "embedding-tier",
        help="dump, load, clear or show the status of a running embedding tier (via a worker)",
        description="Administer a running embedding tier through one of its embedding workers.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("dump", "every shard writes its part; the worker writes the manifest (atomic)"),
        ("load", "load a checkpoint, re-sharding when the shard count differs"),
        ("status", "rows, capacity and task per shard, the worker's task, pending work"),
        ("clear", "drop every row"),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument(
            "--worker",
            required=True,
            type=grpc_address,
            help="HOST:PORT of an embedding worker (any one of the tier's)",
        )
        action.add_argument(
            "--embedding-config",
            type=path_text,
            default=None,
            help="embedding_config.yml: only checked to be valid, not needed (the worker dumps "
            "with its own config and checks a checkpoint it loads against it)",
        )
        # A status is a quick read: its deadline is the client's usual one, not a dump's.
        default_timeout = 30.0 if name == "status" else 600.0
        action.add_argument(
            "--timeout",
            type=positive_float,
            default=default_timeout,
            help=f"deadline (s; default {default_timeout:g})",
        )
        if name in ("dump", "load"):
            action.add_argument("directory", help="checkpoint directory")
        if name == "dump":
            action.add_argument(
                "--overwrite", action="store_true", help="replace an existing checkpoint there"
            )
        action.set_defaults(handler=_admin)


def _progress_bar(stage: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{stage:>5} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _admin(args: argparse.Namespace) -> int:
    from embedding_store.worker_client import RemoteEmbeddingWorker

    config = load_embedding_config(args.embedding_config) if args.embedding_config else None
    with RemoteEmbeddingWorker(
        args.worker, config, timeout=args.timeout, admin_timeout=args.timeout
    ) as worker:
        if args.action == "dump":
            manifest = worker.dump(args.directory, overwrite=args.overwrite, progress=_progress_bar)
            print(
                f"dumped {manifest.total_rows} rows from {manifest.num_shards} shards "
                f"to {manifest.directory}"
            )
        elif args.action == "load":
            manifest = worker.load(args.directory, progress=_progress_bar)
            print(
                f"loaded {manifest.total_rows} rows ({manifest.num_shards} shards in the "
                f"checkpoint) from {manifest.directory}"
            )
        elif args.action == "clear":
            worker.clear()
            print("cleared every shard")
        else:
            status = worker.status(partial=True)
            print("\n".join(format_status(status)))
            if any(status.shard_errors):
                return 1  # a script sees the tier is not whole; the lines say which shard
    return 0


def _task(task: str, progress: float) -> str:
    return f"{task} {progress:.0%}" if task else "idle"


def format_status(status: TierStatus) -> list[str]:
    """The lines of ``recserve embedding-tier status``: one per shard (rows, capacity, task,
    the checkpoint version its rows were loaded from, and ``NOT SERVING`` when it says so),
    the worker's own task, then pending work. A task reads ``idle`` or e.g. ``dumping 50%``;
    a version ``none`` (nothing loaded, or rows changed since by training). A shard that did
    not answer reads ``shard i: NO ANSWER: <why>``."""
    count = len(status.rows_per_shard)
    serving = status.shard_serving or (True,) * count  # not reported
    versions = status.shard_checkpoint_versions or ("",) * count
    errors = status.shard_errors or ("",) * count
    lines = [
        f"shard {index}: NO ANSWER: {error}"
        if error
        else f"shard {index}: {rows} rows of {capacity}, {_task(task, progress)}, "
        f"checkpoint {version or 'none'}" + ("" if shard_serving else ", NOT SERVING")
        for index, (rows, capacity, task, progress, shard_serving, version, error) in enumerate(
            zip(
                status.rows_per_shard,
                status.capacity_per_shard,
                status.shard_tasks,
                status.shard_task_progress,
                serving,
                versions,
                errors,
            )
        )
    ]
    lines.append(f"worker: {_task(status.task, status.task_progress)}")
    lines.append(
        f"pending backward: {status.pending_backward}, pending gradient batches: "
        f"{status.pending_gradient_batches}, non-finite rows skipped: "
        f"{status.nonfinite_rows_skipped}"
    )
    return lines
