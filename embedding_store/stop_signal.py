"""A stop request that SIGTERM/SIGINT handlers can make safely.

Python runs signal handlers in the main thread, between bytecodes, nested when a second
signal lands while the first handler still runs. A handler that calls
``threading.Event.set()`` takes the Event's lock; if a second signal arrives while the first
handler holds it, the nested handler waits for that lock forever and the process never
stops (seen with ``timeout`` and honcho, which both signal twice). :class:`StopRequest`'s
handler only assigns attributes, and the main thread polls it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

log = logging.getLogger(__name__)

#: Seconds between two looks at a process's parent: how late its end may be noticed.
PARENT_CHECK_SECONDS = 0.5


class StopRequest:
    """``handler`` for ``signal.signal``; ``wait`` in the main thread."""

    #: Seconds between two looks at the flag: how late a stop may be noticed.
    POLL_SECONDS = 0.1

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None  # the first signal's name, e.g. "SIGTERM"

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        """Record the request; takes no lock (see the module docstring)."""
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            self.requested = True

    def install(self, *signums: signal.Signals) -> None:
        """Make this the handler of ``signums`` (default SIGTERM and SIGINT)."""
        for signum in signums or (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handler)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.requested:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(self.POLL_SECONDS, left))
            else:
                time.sleep(self.POLL_SECONDS)
        return True


def stop_when_parent_exits(parent: int, who: str) -> None:
    """SIGTERM this process once ``parent`` (a pid) is no longer its parent: killed outright
    (kill -9, the OOM killer), the parent cannot stop it, and a process it started would
    run on, reparented. A daemon thread looks every :data:`PARENT_CHECK_SECONDS`; a parent
    already gone when this is called is noticed at the first look. ``who`` names the
    parent in the log line."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        log.error("%s (pid %d) is gone: this process stops", who, parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
