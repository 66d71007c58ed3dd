"""settle_heap: start-up's survivors frozen, the young threshold raised (and restored after the test)."""

from __future__ import annotations

import gc

from posttrain.core.gcutil import YOUNG, settle_heap


def test_settle_heap_freezes_survivors_and_raises_the_young_threshold():
    before = gc.get_threshold()
    keep = [[i] for i in range(1000)]  # live objects: frozen, not collected
    try:
        # An in-process loop test earlier in the session may have settled the heap already.
        gc.set_threshold(700, before[1], before[2])
        settle_heap()
        assert gc.get_threshold() == (YOUNG, before[1], before[2])
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
