"""``python -m training.torchrun ARGS``: torchrun (``torch.distributed.run``) that reports a
failed rank in one line.

torchrun ends a failed job with a ~35-line ``ChildFailedError`` traceback about its own
internals, after the rank has already printed its own error (an argparse message, a recserve
error). ``recserve train`` runs this instead: the same launcher and exit status, one line that
names the rank and its exit code; a SIGTERM/SIGINT to the launcher is one line too (exit
128 + the signal), not torchrun's ``SignalException`` traceback. A signal that arrives when
every rank of this node has already finished (exit 0: the run completed and wrote what it
writes at its end) is not a stop: the launcher says so and exits 0.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

#: Each rank's exit status as torchrun's shutdown left it (local rank -> returncode, None when
#: still running), recorded by :func:`_record_exits`; empty until torchrun closed its ranks.
_rank_exits: dict[int, int | None] = {}


def _record_exits(close: Callable[..., None]) -> Callable[..., None]:
    """``PContext.close`` that keeps each rank's exit status: torchrun raises the
    SignalException after closing its ranks and keeps no result, so without it a run whose
    ranks had all finished would be reported as stopped."""

    @functools.wraps(close)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            close(self, *args, **kwargs)
        finally:
            handlers = getattr(self, "subprocess_handlers", None) or {}
            if handlers:
                _rank_exits.clear()
                _rank_exits.update({rank: h.proc.poll() for rank, h in handlers.items()})

    return wrapper


def _shutdown_timeout(argv: list[str]) -> str:
    """The ``--shutdown-timeout`` torchrun got (seconds, as text), else its default 30."""
    for i, arg in enumerate(argv):
        if arg.startswith("--shutdown-timeout="):
            return arg.split("=", 1)[1]
        if arg == "--shutdown-timeout" and i + 1 < len(argv):
            return argv[i + 1]
        if not arg.startswith("-"):
            break  # the script: what follows is its own
    return "30"


def _stopped(stop: SignalException, exits: dict[int, int | None], grace: str) -> int:
    """The launcher's line and exit status for a signal that reached it."""
    name = stop.sigval.name
    if exits and all(code == 0 for code in exits.values()):
        print(
            f"recserve train: {name} arrived after every rank had finished (exit 0): "
            "the run completed",
            file=sys.stderr,
        )
        return 0
    killed = sorted(rank for rank, code in exits.items() if code in (-signal.SIGKILL, None))
    cut = (
        f"; rank(s) {', '.join(map(str, killed))} had not stopped {grace} s after it "
        "(--shutdown-timeout) and were killed: a checkpoint they were writing was not "
        "published (the previous one is intact)"
        if killed
        else ""
    )
    print(f"recserve train: stopped by {name}{cut}", file=sys.stderr)
    return 128 + int(stop.sigval)


def main() -> int:
    _rank_exits.clear()
    pcontext = multiprocessing_api.PContext
    original_close = pcontext.close
    pcontext.close = _record_exits(original_close)  # type: ignore[method-assign]
    try:
        torchrun()
    except SignalException as stop:
        # SIGTERM/SIGINT to the launcher: torchrun has already ended its ranks.
        return _stopped(stop, dict(_rank_exits), _shutdown_timeout(sys.argv[1:]))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = failure.exitcode
        others = len(error.failures) - 1
        stopped = f"; {others} other rank(s) stopped with it" if others else ""
        if code < 0:  # killed: it printed nothing; what is above is the others' reaction
            what = f"was killed by {failure.signal_name()}{stopped}"
        else:
            what = f"exited with code {code} (its own error is above{stopped})"
        print(f"recserve train: rank {rank} {what}", file=sys.stderr)
        return code if code > 0 else 1
    finally:
        pcontext.close = original_close  # type: ignore[method-assign]
    return 0


if __name__ == "__main__":
    sys.exit(main())
