"""freeze_long_lived_objects: objects alive at start-up leave the collector's generations."""

from __future__ import annotations

import gc
import weakref

from embedding_store.gc_tuning import collect_released_objects, freeze_long_lived_objects


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
