"""A checkpoint file that blocks its reader until the test says so (a named pipe).

A parameter server reads every checkpoint file with one ``read_bytes()``; when the file is a
FIFO, that read waits in ``open()`` until the test opens the other end and writes the file's
real bytes. So a load is held in flight for exactly as long as a test needs, with no sleeps
and no races: the shard reports the task ``"loading"`` the whole time.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path


def replace_with_fifo(path: Path) -> bytes:
    """Swap the file at ``path`` for a FIFO; returns the file's bytes (to :func:`feed`)."""
    payload = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    return payload


def feed(path: Path, payload: bytes, timeout: float = 30.0, *, hold: float = 0.0) -> None:
    """Write ``payload`` into the FIFO at ``path`` once its reader has opened it, then close it
    (the reader sees EOF). AssertionError if no reader opens it within ``timeout`` seconds.
    ``hold``: seconds to keep the reader waiting after it opened the FIFO, before writing."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            # Non-blocking: fails with ENXIO while nobody reads, instead of waiting forever.
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
            assert time.monotonic() < deadline, f"nobody opened {path} for reading"
            time.sleep(0.02)
    try:
        time.sleep(hold)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)  # the reader drains the pipe
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
