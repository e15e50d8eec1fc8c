"""``recserve train`` and ``recserve data-loader``: run user scripts with the right environment.

``train`` runs the training script under torchrun (so DDP ranks, world size and rendezvous come
from torch.distributed, never from a home-made cluster manager); ``data-loader`` runs a data
loader script as replica I of N. Both replace this process with the script (exec), so signals
and exit codes belong to the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from embedding_store.cli_types import (
    grpc_addresses,
    host_port_addresses,
    non_negative_int,
    path_text,
    positive_int,
)
from training.env import (
    EMBEDDING_WORKERS_ENV,
    NN_WORKERS_ENV,
    NUM_LOADERS_ENV,
    REPLICA_INDEX_ENV,
    REPLICA_SIZE_ENV,
)

#: torchrun's own default ``--shutdown-timeout`` (torch 2.13): the ranks' grace after a signal.
SHUTDOWN_TIMEOUT_SECONDS = 30


def _rendezvous_port(text: str) -> int:
    """A TCP port in 1..65535: the other nodes must know where node 0's rendezvous is."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entry", required=True, type=path_text, help="the Python script to run")
    parser.add_argument(
        "--embedding-config", type=path_text, help="embedding_config.yml (for the script)"
    )
    parser.add_argument(
        "--global-config", type=path_text, help="global_config.yml (for the script)"
    )
    parser.add_argument(
        "--nn-worker-addresses",
        type=host_port_addresses,  # each rank listens on its entry's port, loaders dial them
        help="comma-separated HOST:PORT of the NN workers' data receivers, rank order",
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments after --")


#: --master-addr when not given: on one node the rendezvous is local anyway.
DEFAULT_MASTER_ADDR = "127.0.0.1"


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="run a training script under torchrun",
        description="Run a training script (which uses training.ctx.TrainCtx) under torchrun.",
    )
    _common(train)
    train.add_argument(
        "--nproc-per-node", type=int, default=1, help="NN workers on this node (default 1)"
    )
    train.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    train.add_argument(
        "--node-rank", type=int, default=0, help="this node's index in the job (default 0)"
    )
    train.add_argument(
        "--master-addr",
        default=DEFAULT_MASTER_ADDR,
        help="address of node 0, where torchrun's rendezvous runs, with --nnodes > 1 or "
        "--master-port (default 127.0.0.1)",
    )
    train.add_argument(
        "--master-port",
        type=_rendezvous_port,
        default=None,
        help="port of the rendezvous on node 0 (default 29500; on one node without it, "
        "torchrun --standalone picks a free one)",
    )
    train.add_argument(
        "--embedding-workers",
        type=grpc_addresses,
        help="comma-separated embedding-worker addresses (default: embedded, in-process)",
    )
    train.add_argument(
        "--num-data-loaders",
        type=positive_int,
        default=None,
        help="how many data loaders stream batches: what the script's StreamingDataset "
        "waits for unless the script passes num_loaders itself (an integer > 0; without "
        "it, 1)",
    )
    train.add_argument(
        "--shutdown-timeout",
        type=non_negative_int,
        default=SHUTDOWN_TIMEOUT_SECONDS,
        help="seconds the ranks have to stop after a SIGTERM/SIGINT to this launcher before "
        "torchrun kills them (SIGKILL): long enough for a --checkpoint-on-stop write of the "
        "whole embedding tier; a write cut short publishes nothing and the previous "
        "checkpoint stays intact (default 30, torchrun's)",
    )
    train.set_defaults(handler=_train)

    loader = subparsers.add_parser(
        "data-loader",
        help="run a data-loader script as replica I of N",
        description="Run a data-loader script (which uses training.data.DataCtx) as one replica.",
    )
    _common(loader)
    loader.add_argument(
        "--replica-index", type=int, required=True, help="this loader's index I, from 0"
    )
    loader.add_argument(
        "--replica-size", type=int, required=True, help="how many loaders N run the script"
    )
    loader.set_defaults(handler=_data_loader)


def _environment(args: argparse.Namespace) -> dict[str, str]:
    entry = Path(args.entry)
    if not entry.is_file():
        raise SystemExit(f"recserve {args.command}: error: --entry {entry} is not a file")
    for flag, path in (
        ("--embedding-config", args.embedding_config),
        ("--global-config", args.global_config),
    ):
        # Checked here, not by every rank after torchrun started it (a traceback per rank).
        if path and not Path(path).is_file():
            raise SystemExit(f"recserve {args.command}: error: {flag} {path} is not a file")
    env = dict(os.environ)
    if args.embedding_config:
        env["RECSERVE_EMBEDDING_CONFIG"] = str(Path(args.embedding_config).absolute())
    if args.global_config:
        env["RECSERVE_GLOBAL_CONFIG"] = str(Path(args.global_config).absolute())
    if args.nn_worker_addresses:
        env[NN_WORKERS_ENV] = args.nn_worker_addresses
    return env


def _script_args(args: argparse.Namespace) -> list[str]:
    rest = list(args.script_args)
    return rest[1:] if rest[:1] == ["--"] else rest


def _train(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise SystemExit("recserve train: error: --nproc-per-node and --nnodes must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        # torchrun would wait at the rendezvous for a node that never comes (or, on one
        # node, start standalone and ignore it): say so before anything starts.
        raise SystemExit(
            f"recserve train: error: --node-rank {args.node_rank} must be in "
            f"[0, --nnodes {args.nnodes})"
        )
    if args.nnodes == 1 and args.master_port is None and args.master_addr != DEFAULT_MASTER_ADDR:
        # Refused, not ignored: one node without --master-port runs torchrun --standalone,
        # whose rendezvous is on this node whatever --master-addr says; the address is a job
        # of several nodes meant (--nnodes forgotten), which would otherwise train alone.
        raise SystemExit(
            f"recserve train: error: --master-addr {args.master_addr} is not used on one node "
            "(the rendezvous runs here): give --nnodes N for a job of several nodes, or "
            "--master-port to meet at that address, or leave --master-addr out"
        )
    ranks = args.nproc_per_node * args.nnodes
    addresses = [a for a in (args.nn_worker_addresses or "").split(",") if a.strip()]
    if addresses and len(addresses) != ranks:
        # Rank r listens on entry r and the loaders spread batches over every entry: with
        # more entries, batches went to ports nobody listened on (the loaders waited out
        # their timeout); with fewer, ranks shared an entry (a bind error, or no data).
        raise SystemExit(
            f"recserve train: error: --nn-worker-addresses lists {len(addresses)} address(es) "
            f"for {ranks} NN worker(s) (--nproc-per-node {args.nproc_per_node} x --nnodes "
            f"{args.nnodes}): give one per NN worker, in rank order"
        )
    env = _environment(args)
    if args.embedding_workers:
        env[EMBEDDING_WORKERS_ENV] = args.embedding_workers
    if ranks > 1 and not env.get(EMBEDDING_WORKERS_ENV):
        # Each rank would otherwise fail with its own traceback once torchrun started it.
        raise SystemExit(
            "recserve train: error: more than one NN worker needs one shared embedding tier: "
            "pass --embedding-workers HOST:PORT (a `recserve embedding-worker`; "
            "docs/deploy.md shows how to start one)"
        )
    if args.num_data_loaders is not None:
        env[NUM_LOADERS_ENV] = str(args.num_data_loaders)
    command = [sys.executable, "-m", "training.torchrun"]  # torchrun, failures in one line
    if args.nnodes == 1 and args.master_port is None:
        command += ["--standalone"]
    else:
        command += [
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port or 29500}",
        ]
    command += [
        f"--nproc-per-node={args.nproc_per_node}",
        # Always given: torchrun would otherwise read TORCH_ELASTIC_SHUTDOWN_TIMEOUT, and the
        # launcher's stop line names this value.
        f"--shutdown-timeout={args.shutdown_timeout}",
        args.entry,
        *_script_args(args),
    ]
    os.execve(sys.executable, command, env)
    return 0  # not reached


def _data_loader(args: argparse.Namespace) -> int:
    if not 0 <= args.replica_index < args.replica_size:
        raise SystemExit(
            f"recserve data-loader: error: --replica-index {args.replica_index} must be in "
            f"[0, --replica-size {args.replica_size})"
        )
    env = _environment(args)
    env[REPLICA_INDEX_ENV] = str(args.replica_index)
    env[REPLICA_SIZE_ENV] = str(args.replica_size)
    os.execve(sys.executable, [sys.executable, args.entry, *_script_args(args)], env)
    return 0  # not reached
