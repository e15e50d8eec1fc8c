"""The single ``recserve`` command line.

Subcommands are contributed by packages through the ``recserve.commands`` entry-point group:
each entry point names a module with ``register(subparsers) -> None``. That keeps the
dependency direction one way (this module never imports ``training`` or ``serving``), and a
missing optional package only hides its commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import entry_points

from embedding_store import __version__
from embedding_store.errors import RecserveError

log = logging.getLogger("recserve")

COMMAND_GROUP = "recserve.commands"


def build_parser() -> argparse.ArgumentParser:
    """Parser with every registered subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="recserve",
        description="Train and serve deep recommendation models with sharded embedding tables.",
    )
    parser.add_argument("--version", action="version", version=f"recserve {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the least severe log messages shown (default INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            module = import_module(entry.value)
        except ImportError as error:  # a broken optional package hides only its commands
            print(
                f"recserve: warning: commands of {entry.value} unavailable: {error}",
                file=sys.stderr,
            )
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``recserve`` console script. Returns the process exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = ""
        if getattr(args, "command", None) in ("train", "data-loader"):
            hint = (
                f" (arguments for the --entry script go after --: recserve {args.command} "
                f"--entry SCRIPT -- {' '.join([*unknown, *getattr(args, 'script_args', [])])})"
            )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except RecserveError as error:
        print(f"recserve {args.command}: error: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: the reader left; not an error of ours.
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:  # a path that cannot be read or written: the user's to fix
        log.debug("%s failed", args.command, exc_info=error)
        where = f": {error.filename}" if error.filename else ""
        print(f"recserve {args.command}: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
