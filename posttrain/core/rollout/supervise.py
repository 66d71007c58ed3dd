"""Keeping a run's engines serving through failures: weight pushes that survive an engine dying mid-push,
and a watcher that moves requests off an engine that died mid-generation."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from posttrain.core.watchdog import waiting_on

log = logging.getLogger("posttrain.rollout")


def push_weights(trainer: Any, engines: Any, version: int, disk_dir: str,
                 attempts: int = 3) -> tuple[list[str], float, int]:
    """New weights to every engine, surviving engines that die before or during the push.

    Each attempt first restarts dead engines (``engines.check_and_restart``: same port, or a fresh one),
    rebuilds the weight-update group when anything changed (a restarted engine, or a failed attempt,
    leaves the old group broken), then pushes. Every HTTP call and collective of a push is bounded
    (``rollout.weight_sync_timeout_s``), so a death mid-push fails the attempt in bounded time instead of
    hanging the next generation. Returns the URLs of restarted engines, the seconds of the successful push
    and its bytes (``TrainerRole.push_weights``); the last attempt's error propagates. The whole of it is one
    wait for the watchdog.
    """
    with waiting_on("weight_push", f"weight push of version {version} to {', '.join(engines.urls()[1])}"):
        return _push_attempts(trainer, engines, version, disk_dir, attempts)


def _push_attempts(trainer: Any, engines: Any, version: int, disk_dir: str,
                   attempts: int) -> tuple[list[str], float, int]:
    restarted: list[str] = []
    for attempt in range(attempts):
        now = engines.check_and_restart()
        restarted += now
        if now or attempt:
            trainer.connect_engines(engines.urls()[1])
        try:
            return restarted, *trainer.push_weights(version, disk_dir)
        except (RuntimeError, OSError) as exc:
            if attempt == attempts - 1:
                raise
            log.warning("weight push %s failed (attempt %d of %d): %s", version, attempt + 1, attempts, exc)
            time.sleep(1.0)  # let the process table show the death before checking again
    return restarted, 0.0, 0


async def watching(engines: Any, engine: Any, generation: Any, every_s: float = 1.0) -> tuple[Any, float]:
    """Await ``generation`` while watching the engines: when one dies, it leaves the router and the
    requests in flight are sent again (to the live engines); the weight push restarts it. Returns the
    result and its own wall time (in async mode it overlaps training, so the step's phases miss it)."""
    start = time.perf_counter()

    async def watch():
        while True:
            await asyncio.sleep(every_s)
            if await asyncio.to_thread(engines.drop_dead):
                engine.interrupt()

    watcher = asyncio.ensure_future(watch())
    try:
        return await generation, time.perf_counter() - start
    finally:
        watcher.cancel()
