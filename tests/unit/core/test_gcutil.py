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


def test_what_settle_heap_froze_is_freed_at_exit():
    """The collection at interpreter shutdown skips frozen objects: a cycle alive when the heap settled (a
    module's global) is freed at exit only because settle_heap unfreezes then, where triton is loaded (else its
    objects were reported leaked by nanobind at the end of every run)."""
    import subprocess
    import sys

    script = ("import sys\n"
              "sys.modules.setdefault('triton', type(sys)('triton'))\n"  # only where triton is loaded
              "from posttrain.core.gcutil import settle_heap\n"
              "class Cycle:\n"
              "    def __init__(self): self.me = self\n"
              "    def __del__(self): sys.stdout.write('freed'); sys.stdout.flush()\n"
              "keep = Cycle()\n"
              "settle_heap()\n"
              "settle_heap()\n")  # twice: one unfreeze at exit is enough
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "freed", (out.stdout, out.stderr)
