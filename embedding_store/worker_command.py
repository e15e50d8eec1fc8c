"""``recserve embedding-worker``: route batches to parameter-server shards over gRPC."""

from __future__ import annotations

import argparse

from embedding_store.config import load_embedding_config, load_global_config


def _addresses(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{address!r} is not HOST:PORT")
    if not addresses:
        raise argparse.ArgumentTypeError("give at least one HOST:PORT")
    return addresses


def register(subparsers) -> None:
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
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--embedding-config", default=None, help="embedding_config.yml")
    parser.add_argument("--global-config", default=None, help="global_config.yml")
    parser.add_argument(
        "--shard-timeout", type=float, default=10.0, help="deadline of each shard call (s)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=60.0, help="wait this long for the shards (s)"
    )
    parser.add_argument(
        "--grace-seconds", type=float, default=5.0, help="drain time on SIGTERM (s)"
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from embedding_store.worker_service import serve_embedding_worker

    embedding_config = load_embedding_config(args.embedding_config)
    global_config = load_global_config(args.global_config)
    shards = args.ps or list(global_config.common_config.infer_config.servers)
    if not shards:
        raise SystemExit(
            "recserve embedding-worker: error: no shards: pass --ps HOST:PORT[,HOST:PORT...] "
            "or set common_config.infer_config.servers in the global config"
        )
    return serve_embedding_worker(
        embedding_config,
        shards,
        host=args.host,
        port=args.port,
        forward_buffer_size=global_config.embedding_worker_config.forward_buffer_size,
        shard_timeout=args.shard_timeout,
        startup_timeout=args.startup_timeout,
        grace_seconds=args.grace_seconds,
    )
