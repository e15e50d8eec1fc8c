"""The single ``recserve`` command line.

Subcommands are contributed by packages through the ``recserve.commands`` entry-point group:
each entry point names a module with ``register(subparsers) -> None``. That keeps the
dependency direction one way (this module never imports ``training`` or ``serving``), and a
missing optional package only hides its commands.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import entry_points
from typing import NoReturn

from embedding_store import __version__
from embedding_store.errors import RecserveError

log = logging.getLogger("recserve")

COMMAND_GROUP = "recserve.commands"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors point out a mistyped flag (``--chekpoint``: "did you
    mean --checkpoint?"). argparse reports a missing required flag before an unknown one,
    so without this a typo in a required flag read as "--checkpoint is required"."""

    _seen: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._seen = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def close_flags(self, tokens: Sequence[str]) -> str:
        """ " (--chekpoint: did you mean --checkpoint?)" for the flags among ``tokens`` (up
        to a ``--``) that this parser does not take but has one close to, or ""."""
        known = [flag for action in self._actions for flag in action.option_strings]
        hints = []
        for token in tokens:
            if token == "--":
                break  # the --entry script's own arguments follow
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                match = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
                if match:
                    hints.append(f"{name}: did you mean {match[0]}?")
        return f" ({'; '.join(hints)})" if hints else ""

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            message += self.close_flags(self._seen)
        super().error(message)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Parser | None:
    """The (sub)parser that took ``args``' command (and action: ``checkpoint inspect``)."""
    found = None
    current: argparse.ArgumentParser = parser
    while True:
        subparsers = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subparsers[0].dest, None) if subparsers else None
        if chosen is None or chosen not in subparsers[0].choices:
            return found
        current = subparsers[0].choices[chosen]
        found = current if isinstance(current, _Parser) else None


def build_parser() -> argparse.ArgumentParser:
    """Parser with every registered subcommand attached."""
    parser = _Parser(
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
        command_parser = _command_parser(parser, args)
        hint = command_parser.close_flags(unknown) if command_parser else ""
        if getattr(args, "command", None) in ("train", "data-loader") and not hint:
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
