"""TLS files that follow a renewal in place, with no restart.

cert-manager renews a certificate into a Secret, and the kubelet swaps the mounted files
atomically (``tls.crt -> ..data/tls.crt``, then ``..data`` renamed to a new directory).
:class:`ReloadingTls` holds what was loaded from a set of files and, when asked
(:meth:`ReloadingTls.check`, from each new TLS handshake), stats the files at most every
``interval`` seconds and loads them again only when a stat changed (device, inode, size,
mtime or ctime: a swapped symlink, a rename over the file or a rewrite all change one).

A bad renewal never takes a server down: files that are missing, half-written, not PEM, or a
key that does not match its certificate leave the previous files in use, with one warning
per change naming the file and the problem; the next change is tried again. A change seen
while the files were still being read is looked at again at the next check, with no warning.

Shared by ``recserve serve`` (serving/tls.py) and the embedding tier (grpc_common.py). Light
to import: grpc only when gRPC credentials are built.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from embedding_store.errors import RecserveError

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

#: Seconds between two looks at the TLS files (a stat of each, on a new handshake): a renewal
#: is served at most this long after the kubelet swapped the files.
DEFAULT_RELOAD_SECONDS = 10.0

#: The outcomes a listener is told about (a ``..._tls_reloads_total{outcome}`` counter).
RELOAD_OUTCOMES = ("ok", "failed")

T = TypeVar("T")

#: Per file, what stat says (device, inode, size, mtime ns, ctime ns) or why it failed.
Stamp = tuple[tuple[int, ...] | str, ...]


def file_stamp(paths: Sequence[Path]) -> Stamp:
    """What ``os.stat`` (following symlinks, as the kubelet's ``..data`` links need) says of
    each of ``paths``: equal stamps mean unchanged files, for a fraction of a read's cost."""
    stamp: list[tuple[int, ...] | str] = []
    for path in paths:
        try:
            status = os.stat(path)
        except OSError as error:  # missing now: a change too (and a failed load)
            stamp.append(f"{type(error).__name__} {error.errno}")
        else:
            stamp.append(
                (
                    status.st_dev,
                    status.st_ino,
                    status.st_size,
                    status.st_mtime_ns,
                    status.st_ctime_ns,
                )
            )
    return tuple(stamp)


class ReloadingTls(Generic[T]):
    """What ``load()`` made of ``paths``, made again when the files change.

    ``load`` reads and checks the files and raises a :class:`RecserveError` naming the file
    and the problem for bad ones; the first call (here) raises it to the caller (start-up),
    later ones are logged and counted. ``interval`` <= 0: the files are loaded once only.
    ``what`` names the files in log lines (``"--tls-cert/--tls-key"``). Thread-safe: gRPC
    calls :meth:`check` from its own threads."""

    def __init__(
        self,
        paths: Sequence[Path],
        load: Callable[[], T],
        *,
        interval: float = DEFAULT_RELOAD_SECONDS,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = tuple(Path(path) for path in paths)
        self.interval = interval
        self.what = what
        self._load = load
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        #: Reload attempts by outcome since start-up (tier metrics read them at a scrape).
        self.counts = dict.fromkeys(RELOAD_OUTCOMES, 0)
        stamp = file_stamp(self.paths)
        # (generation, value): one attribute, so a reader never pairs one with another's.
        self._current: tuple[int, T] = (0, load())
        self._stamp = stamp  # of the files last loaded, or last refused
        self._next_check = clock() + interval

    @property
    def current(self) -> tuple[int, T]:
        """(generation, value) as last loaded, without looking at the files; generation 0
        is the start-up load, and each reload adds 1."""
        return self._current

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(outcome)`` after each reload attempt: ``"ok"`` or ``"failed"``."""
        self._listeners.append(listener)

    def check(self) -> tuple[int, T]:
        """:attr:`current`, reloaded first if ``interval`` has passed since the last look
        and the files changed. Cheap: a clock read, and every ``interval`` a stat per file.
        A check already running in another thread is not waited for (a handshake must not
        queue behind a reload): this one answers what is loaded now."""
        if self.interval <= 0 or self._clock() < self._next_check:
            return self._current
        if self._lock.acquire(blocking=False):
            try:
                if self._clock() >= self._next_check:
                    self._next_check = self._clock() + self.interval
                    self._reload_if_changed()
            finally:
                self._lock.release()
        return self._current

    def reload_now(self) -> bool:
        """Look at the files now, whatever the interval; True when they were reloaded."""
        with self._lock:
            self._next_check = self._clock() + self.interval
            return self._reload_if_changed()

    def _reload_if_changed(self) -> bool:
        stamp = file_stamp(self.paths)
        if stamp == self._stamp:
            return False
        try:
            value = self._load()
        except Exception as error:
            if file_stamp(self.paths) != stamp:
                return False  # still being written: the next check looks again
            self._stamp = stamp  # warn once per change, not on every handshake
            if isinstance(error, RecserveError):
                problem = error.message
            else:  # a bug, not a file: its traceback belongs in the log
                log.error("%s: reloading the TLS files failed", self.what, exc_info=True)
                problem = f"{type(error).__name__}: {error}"
            log.warning(
                "%s: the changed TLS files were not loaded, the previous certificate stays "
                "in use: %s (tried again when the files change)",
                self.what,
                problem,
            )
            self._tell("failed")
            return False
        if file_stamp(self.paths) != stamp:
            return False  # changed while read: the next check loads the newest
        generation = self._current[0] + 1
        self._current, self._stamp = (generation, value), stamp
        log.info(
            "%s: reloaded the TLS files (%s): new connections use them",
            self.what,
            ", ".join(str(path) for path in self.paths),
        )
        self._tell("ok")
        return True

    def _tell(self, outcome: str) -> None:
        self.counts[outcome] += 1
        for listener in self._listeners:
            try:
                listener(outcome)
            except Exception:  # a metric must not break a handshake
                log.exception("TLS reload listener failed")


def dynamic_server_credentials(
    files: ReloadingTls[T],
    configuration: Callable[[T], grpc.ServerCertificateConfiguration],
    *,
    require_client_auth: bool,
) -> grpc.ServerCredentials:
    """gRPC server credentials that follow ``files``: gRPC asks the fetcher on each new
    handshake, which answers None (keep the configuration) unless :meth:`ReloadingTls.check`
    loaded a newer generation than this server last took. Open connections keep theirs."""
    import grpc

    generation, value = files.current
    sent = [generation]
    lock = threading.Lock()

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            generation, value = files.check()
            # Two handshakes may fetch at once, and a check that read the files' current
            # generation just before a reload answers after it: never hand gRPC an older
            # generation than it has (new connections would get the replaced files).
            with lock:
                if generation <= sent[0]:
                    return None
                sent[0] = generation
            return configuration(value)
        except Exception:  # raised into gRPC's core it would fail the handshake
            log.exception("%s: fetching the TLS configuration failed", files.what)
            return None

    return grpc.dynamic_ssl_server_credentials(
        configuration(value), fetch, require_client_authentication=require_client_auth
    )
