"""``recserve`` subcommands of the embedding tier (registered via ``recserve.commands``).

Each subcommand has its own ``_register_*`` function; :func:`register` calls them all.
Server modules are imported inside the handlers, so ``recserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from embedding_store.checkpoint_manifest import MAX_SHARDS
from embedding_store.cli_types import int_in_range, non_empty, non_negative_float, path_text
from embedding_store.config import (
    EMBEDDING_CONFIG_ENV,
    EMBEDDING_CONFIG_FLAG,
    GLOBAL_CONFIG_ENV,
    GLOBAL_CONFIG_FLAG,
)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        EMBEDDING_CONFIG_FLAG,
        dest="embedding_config",
        type=path_text,
        metavar="FILE",
        help=f"embedding_config.yml (default: ${EMBEDDING_CONFIG_ENV})",
    )
    parser.add_argument(
        GLOBAL_CONFIG_FLAG,
        dest="global_config",
        type=path_text,
        metavar="FILE",
        help=f"global_config.yml (default: ${GLOBAL_CONFIG_ENV}, else all defaults)",
    )


# --------------------------------------------------------------------------- parameter server
def _register_parameter_server(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "embedding-parameter-server",
        help="run one embedding parameter-server shard (gRPC)",
        description=(
            "Serve one shard of the embedding table over gRPC. Prints "
            "'parameter server replica I/N listening on HOST:PORT' once bound."
        ),
    )
    _add_config_flags(parser)
    parser.add_argument(
        "--replica-index",
        type=int_in_range(0, None),
        required=True,
        metavar="I",
        help="this shard's index, 0 <= I < N",
    )
    parser.add_argument(
        "--replica-size",
        # At most what a checkpoint manifest holds: a larger tier's dumps would not load.
        type=int_in_range(1, MAX_SHARDS),
        required=True,
        metavar="N",
        help=f"number of parameter-server shards (at most {MAX_SHARDS})",
    )
    parser.add_argument(
        "--port",
        type=int_in_range(0, 65535),
        required=True,
        metavar="P",
        help="gRPC port (0: pick a free one and print it)",
    )
    parser.add_argument(
        "--host",
        type=non_empty,
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int_in_range(0, 65535),
        metavar="M",
        help="serve Prometheus metrics on http://HOST:M/metrics (0: pick a free port; "
        "absent: none)",
    )
    parser.add_argument(
        "--dump-on-exit",
        metavar="DIR",
        type=non_empty,
        help="on SIGTERM/SIGINT write this shard's rows into DIR/shard_{I:05d}/ "
        "(with N = 1 also the manifest, so DIR is a complete checkpoint; with N > 1 the parts "
        "are a last-resort copy, not a loadable checkpoint: take those with "
        "`recserve embedding-tier dump`; a DIR that holds a checkpoint is then refused)",
    )
    parser.add_argument(
        "--load-checkpoint",
        metavar="DIR",
        type=non_empty,
        help="job_type Train only: at start, load this shard's part of the embedding "
        "checkpoint DIR (re-sharded if DIR has another shard count) with its optimizer and "
        "optimizer state when none is configured yet; NOT_SERVING until loaded, exit 1 if "
        "the load fails (Infer shards load infer_config.embedding_checkpoint)",
    )
    parser.add_argument(
        "--dump-root",
        metavar="DIR",
        type=non_empty,
        help="Dump RPCs (`recserve embedding-tier dump`, through the worker) write only into "
        "directories under DIR (symlinks resolved; others: PERMISSION_DENIED). Default: any "
        "directory this user can write, with a warning at start; set it to the checkpoint "
        "volume. --dump-on-exit is not bound by it. A DIR not there yet is resolved as it "
        "would be, with a warning",
    )
    parser.add_argument(
        "--load-root",
        metavar="DIR",
        type=non_empty,
        help="Load RPCs (`recserve embedding-tier load`, through the worker) read only from "
        "directories under DIR (symlinks resolved; others: PERMISSION_DENIED). Default: any "
        "directory this user can read, with a warning at start; set it to the checkpoint "
        "volume. --load-checkpoint and infer_config.embedding_checkpoint are not bound by it",
    )
    parser.add_argument(
        "--grace-seconds",
        type=non_negative_float,
        default=5.0,
        metavar="S",
        help="on shutdown, time in-flight RPCs get to finish (default 5)",
    )
    parser.set_defaults(handler=lambda args: _run_parameter_server(parser, args))


def _run_parameter_server(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.replica_index >= args.replica_size:
        parser.error(
            f"--replica-index must be < --replica-size: got --replica-index {args.replica_index} "
            f"with --replica-size {args.replica_size}"
        )
    if args.metrics_port is not None and args.metrics_port != 0 and args.metrics_port == args.port:
        parser.error(f"--metrics-port must differ from --port, both are {args.port}")
    for flag, root in (("--dump-root", args.dump_root), ("--load-root", args.load_root)):
        # A missing root is allowed (a fresh checkout's runs/, made by the first dump): it
        # binds requests all the same (resolved as it would be), and start-up warns of it.
        if root is not None and Path(root).exists() and not Path(root).is_dir():
            parser.error(f"{flag} {root}: not a directory")

    from embedding_store.config import load_embedding_config, load_global_config
    from embedding_store.ps_process import ParameterServerOptions, serve_parameter_server

    embedding_config = load_embedding_config(args.embedding_config)
    global_config = load_global_config(args.global_config)
    options = ParameterServerOptions(
        replica_index=args.replica_index,
        replica_size=args.replica_size,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        dump_on_exit=args.dump_on_exit,
        load_checkpoint=args.load_checkpoint,
        dump_root=args.dump_root,
        load_root=args.load_root,
        grace_seconds=args.grace_seconds,
    )
    return serve_parameter_server(embedding_config, global_config, options)


# --------------------------------------------------------------------------- registry
def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the embedding tier's subcommands to ``recserve``."""
    _register_parameter_server(subparsers)
