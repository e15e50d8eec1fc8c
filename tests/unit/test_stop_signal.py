"""StopRequest: a stop asked for by signal handlers that may nest."""

from __future__ import annotations

import os
import signal
import threading
import time

from embedding_store.stop_signal import StopRequest


def test_a_signal_arriving_inside_the_handler_does_not_deadlock():
    """The nested call is what a second SIGTERM does while the first handler runs: with a
    handler calling threading.Event.set(), it would wait for a lock its own thread holds."""
    request = StopRequest()

    def nested(signum, frame):
        request.handler(signum, frame)  # the first handler, interrupted ...
        request.handler(signal.SIGINT, frame)  # ... by a second signal

    nested(signal.SIGTERM, None)
    assert request.requested and request.signal_name == "SIGTERM"  # the first one counts
    assert request.wait(timeout=1.0) is True


def test_wait_returns_on_a_real_signal_and_times_out_without_one():
    request = StopRequest()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        request.install()
        started = time.monotonic()
        assert request.wait(timeout=0.3) is False
        assert time.monotonic() - started >= 0.3
        timer = threading.Timer(0.2, lambda: [os.kill(os.getpid(), signal.SIGTERM) for _ in "123"])
        timer.start()
        assert request.wait(timeout=10) is True
        assert request.signal_name == "SIGTERM"
        timer.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
