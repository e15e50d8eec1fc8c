"""The one checkpoint task (dump or load) a service runs at a time, and its progress.

Shards and embedding workers both refuse a second dump or load while one runs (it would
read or replace rows mid-way) and report the running task and its progress in Status.
"""

from __future__ import annotations

import threading

from embedding_store.errors import UnavailableError


class CheckpointTask:
    """``begin(task)`` ... ``end()`` around a dump or load; :meth:`state` for Status.

    ``owner`` names the service in the busy error ("parameter server", "embedding worker").
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._exclusive = threading.Lock()  # held from begin() to end()
        self._state_lock = threading.Lock()  # guards the two fields Status reads
        self._task = ""
        self._progress = 0.0

    def begin(self, task: str, *, wait: float = 0.0) -> None:
        """Start ``task`` ("dumping", "loading") at progress 0; UnavailableError naming the
        running task if one still runs after ``wait`` seconds (0: do not wait)."""
        acquired = (
            self._exclusive.acquire(timeout=wait)
            if wait > 0
            else self._exclusive.acquire(blocking=False)
        )
        if not acquired:
            running, _ = self.state()
            raise UnavailableError(
                f"the {self._owner} is busy {running} a checkpoint; retry when it is done"
            )
        with self._state_lock:
            self._task, self._progress = task, 0.0

    def end(self) -> None:
        """The running task is done (or failed): no task, progress 0."""
        with self._state_lock:
            self._task, self._progress = "", 0.0
        self._exclusive.release()

    def set_progress(self, done: int, total: int) -> None:
        """The running task's progress: ``done / total`` capped to [0, 1] (1 when total <= 0)."""
        fraction = 1.0 if total <= 0 else min(1.0, done / total)
        with self._state_lock:
            self._progress = fraction

    def state(self) -> tuple[str, float]:
        """(task, progress): ("", 0.0) when none runs."""
        with self._state_lock:
            return self._task, self._progress
