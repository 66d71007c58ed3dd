"""The garbage collector in long-running processes (the training loop, the engine server).

After start-up, :func:`settle_heap` collects once and freezes what is left (models, modules, configs:
hundreds of thousands of objects that live as long as the process), so later collections never scan them;
then it raises the young generation's threshold from CPython's 700 allocations to ``YOUNG``. A step
allocates tens of thousands of short-lived objects (per-row request dicts, samples' lists); with a young
threshold of 700 the collector scanned each of them a few times before it died, about 8 ms of a 0.17 s
CPU quickstart step (2,600 young and 235 middle collections in 60 steps). With ``YOUNG`` most die before
any scan: 8 young collections in the same run (bench/RESULTS.md, issue 17). Cyclic garbage waits longer
for its collection, a few MB at most.
"""

from __future__ import annotations

import gc

YOUNG = 100_000  # allocations between young collections (CPython's default: 700)


def settle_heap() -> None:
    """Collect, freeze the survivors (:func:`gc.freeze`) and set the young threshold to ``YOUNG``."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
