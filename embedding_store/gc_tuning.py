"""Keep Python's cyclic garbage collector off the long-lived objects of a server process.

A serving or embedding process holds ~300k container objects that live as long as it does
(torch's modules and the model among them). CPython's full collections traverse all of them:
~100 ms each on the machines measured here, and under load a server's in-flight requests
keep promoting enough survivors to run one about every second. Each stalls every request of
the process for its whole length (the p99 of a batch-1 load went from ~9 ms to ~55-130 ms).
``gc.freeze()`` moves the objects that exist once the process is set up into the permanent
generation, which collections skip; reference counting still frees them.

The young generation is collected every 700 net allocations of containers by default: every
few requests at ~100 containers each. Most of a request's objects are freed by reference
counting before a collection sees them, so a collection mostly traverses the requests still
in flight, and collecting 30x less often traverses them 30x less often. On the serving
process (synthetic model, locust mix of batch sizes over JSON, one process) the collector took
~3% of the CPU (``perf``: ``gc_collect_main`` and its visitors) and a request ~4% less CPU
with :data:`YOUNG_COLLECTION_THRESHOLD` (211-221 -> 203-206 us).
"""

from __future__ import annotations

import gc

#: Net container allocations between two collections of the youngest generation (CPython's
#: default is 700). Cyclic garbage waits longer, a few MB at most.
YOUNG_COLLECTION_THRESHOLD = 20_000


def space_out_young_collections(threshold: int = YOUNG_COLLECTION_THRESHOLD) -> None:
    """Collect the youngest generation every ``threshold`` net container allocations (the
    older generations' thresholds stay as they are)."""
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)


def freeze_long_lived_objects(*, collect: bool = True) -> int:
    """Exempt every object alive now from later collections (``gc.freeze``).

    ``collect`` first frees the garbage of start-up (a ~100 ms full collection, so only at
    start, not while serving). Returns how many objects are frozen now.
    """
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_released_objects() -> int:
    """Free frozen objects that became cyclic garbage (a replaced model), then freeze again.

    Frozen objects are still freed by reference counting, but a frozen reference cycle never
    is. Call this once the long-lived objects replaced since the last freeze are released
    (e.g. after a model reload retired the old version): one full collection (~100 ms) instead
    of keeping the old version's cycles, and the tensors they hold, for good. Returns how many
    objects the collection freed.
    """
    gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    return freed
