"""Retry policy of the clients: exponential backoff with jitter, on transient failures only.

A call is retried only when the server could not take it: HTTP 503, gRPC UNAVAILABLE (or
CANCELLED by a stopping server, or RESOURCE_EXHAUSTED for a server's limit of concurrent
calls), or a refused connection. Never on 4xx / INVALID_ARGUMENT and
the like (resending cannot help), nor on a timeout (the server may still be working on the
request).
"""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass

from embedding_store.cli_types import MAX_FLOAT_VALUE
from embedding_store.errors import InvalidArgumentError, RecserveError

#: The longest wait between two attempts (seconds; 1e6, the longest timeout too).
MAX_BACKOFF_SECONDS = MAX_FLOAT_VALUE


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` extra attempts after the first; the n-th wait (0-based) is drawn uniformly
    from ``[d / 2, d]`` with ``d = min(backoff_max, backoff_min * 2**n)``."""

    retries: int = 3
    backoff_min: float = 0.05
    backoff_max: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, numbers.Integral):
            raise InvalidArgumentError(f"retries must be an integer, got {self.retries!r}")
        object.__setattr__(self, "retries", int(self.retries))
        if self.retries < 0:
            raise InvalidArgumentError(f"retries must be >= 0, got {self.retries}")
        # At most MAX_BACKOFF_SECONDS, as a timeout: inf or 1e300 used to reach time.sleep
        # at the first retry as a raw ValueError ("Invalid value NaN") or OverflowError.
        if not 0 <= self.backoff_min <= self.backoff_max <= MAX_BACKOFF_SECONDS:
            raise InvalidArgumentError(
                f"backoff must be (min, max) seconds, at most {MAX_BACKOFF_SECONDS:.0f}, with "
                f"0 <= min <= max, got ({self.backoff_min}, {self.backoff_max})"
            )

    def delay(self, attempt: int) -> float:
        try:
            ceiling = min(self.backoff_max, self.backoff_min * 2.0**attempt)
        except OverflowError:  # 2.0**1024: the 1025th retry of a patient client
            ceiling = self.backoff_max
        return random.uniform(ceiling / 2, ceiling)


class RetryableError(Exception):
    """Internal signal of a backend: this attempt failed transiently; ``error`` is what the
    caller gets once the retries are used up. Never escapes a client."""

    def __init__(self, error: RecserveError) -> None:
        super().__init__(error.message)
        self.error = error


def exhausted(retry: RetryableError, attempts: int) -> RecserveError:
    """The error to raise after ``attempts`` attempts all failed transiently."""
    error = retry.error
    if attempts <= 1:
        return error
    return type(error)(f"{error.message} (gave up after {attempts} attempts)")
