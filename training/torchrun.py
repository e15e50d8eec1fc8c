"""``python -m training.torchrun ARGS``: torchrun (``torch.distributed.run``) that reports a
failed rank in one line.

torchrun ends a failed job with a ~35-line ``ChildFailedError`` traceback about its own
internals, after the rank has already printed its own error (an argparse message, a recserve
error). ``recserve train`` runs this instead: the same launcher and exit status, one line that
names the rank and its exit code; a SIGTERM/SIGINT to the launcher is one line too (exit
128 + the signal), not torchrun's ``SignalException`` traceback.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main() -> int:
    try:
        torchrun()
    except SignalException as stop:
        # SIGTERM/SIGINT to the launcher: torchrun has already ended its ranks.
        print(f"recserve train: stopped by {stop.sigval.name}", file=sys.stderr)
        return 128 + int(stop.sigval)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
