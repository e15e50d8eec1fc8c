"""freeze_long_lived_objects: objects alive at start-up leave the collector's generations."""

from __future__ import annotations

import gc
import weakref

import pytest

from embedding_store.gc_tuning import (
    YOUNG_COLLECTION_THRESHOLD,
    collect_released_objects,
    freeze_long_lived_objects,
    space_out_young_collections,
)


class _Node:
    def __init__(self) -> None:
        self.self_reference = self


def test_freeze_frees_startup_garbage_then_freezes_what_lives() -> None:
    gc.unfreeze()
    try:
        garbage = _Node()
        garbage_ref = weakref.ref(garbage)
        del garbage  # a cycle: only a collection frees it
        long_lived = [[index] for index in range(1000)]
        frozen = freeze_long_lived_objects()
        assert garbage_ref() is None
        assert frozen == gc.get_freeze_count() >= len(long_lived)
        later = [[index] for index in range(10)]
        assert freeze_long_lived_objects(collect=False) >= frozen + len(later)
    finally:
        gc.unfreeze()


def test_released_frozen_cycles_are_freed_by_collect_released_objects() -> None:
    gc.unfreeze()
    try:
        replaced = _Node()  # a replaced model: frozen while it served, then dropped
        replaced_ref = weakref.ref(replaced)
        freeze_long_lived_objects()
        del replaced
        gc.collect()
        assert replaced_ref() is not None  # frozen cycles survive ordinary collections
        assert collect_released_objects() >= 1
        assert replaced_ref() is None
        assert gc.get_freeze_count() > 0  # what still lives is frozen again
    finally:
        gc.unfreeze()


def _young_collections_while_allocating(containers: int) -> int:
    """How many collections of the youngest generation allocating ``containers`` lists
    (kept alive) triggers."""
    started = 0

    def count(phase: str, info: dict) -> None:
        nonlocal started
        if phase == "start" and info["generation"] == 0:
            started += 1

    kept = []
    gc.collect()
    gc.callbacks.append(count)
    try:
        for index in range(containers):
            kept.append([index])
    finally:
        gc.callbacks.remove(count)
    return started


def test_young_collections_are_spaced_out_and_older_thresholds_kept() -> None:
    default = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert _young_collections_while_allocating(7000) >= 9
        space_out_young_collections()
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, 10, 10)
        assert YOUNG_COLLECTION_THRESHOLD == 20_000
        # At most one: a collection another thread's allocations happen to trigger.
        assert _young_collections_while_allocating(7000) <= 1
        assert _young_collections_while_allocating(2 * YOUNG_COLLECTION_THRESHOLD) >= 1
        with pytest.raises(ValueError, match="threshold must be >= 1, got 0"):
            space_out_young_collections(0)
    finally:
        gc.set_threshold(*default)


def test_freeze_without_collect_keeps_startup_garbage_frozen() -> None:
    """``collect=False`` (a later freeze while serving) must not run the ~100 ms full
    collection: cyclic garbage alive at that moment is frozen, not freed."""
    gc.unfreeze()
    try:
        gc.collect()
        garbage = _Node()
        garbage_ref = weakref.ref(garbage)
        del garbage
        freeze_long_lived_objects(collect=False)
        assert garbage_ref() is not None
        gc.collect()
        assert garbage_ref() is not None  # frozen: ordinary collections skip it
        collect_released_objects()
        assert garbage_ref() is None
    finally:
        gc.unfreeze()
