"""Sync tools run in worker processes: one stuck in C code is killed at its timeout and the event loop
keeps running meanwhile; failures come back as error text; the worker is replaced after a kill."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from posttrain.core.rollout.tool_workers import ToolFailed, ToolTimeout, ToolWorkers
from posttrain.core.rollout.tools import ToolCall, run_tool
from posttrain.plugins.tools.calculator import calculator


def stuck_in_c(n: int = 9) -> str:
    """Holds the GIL in one C call for about a minute (a thread could never be interrupted)."""
    return str((((n ** 64) ** 64) ** 64) ** 64 % 10)


def whoami() -> str:
    return str(os.getpid())


def fails() -> str:
    raise KeyError("missing")


def dies() -> str:
    os._exit(3)


async def loop_gaps_while(coro) -> tuple[object, float, float]:
    """Run ``coro`` while a ticker measures the longest time the event loop was held; (result, gap, seconds)."""
    gaps, stop = [0.0], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now
    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    try:
        result = await coro
    finally:
        stop.set()
        await task
    return result, gaps[0], time.perf_counter() - start


async def test_a_tool_stuck_in_c_times_out_without_blocking_the_loop():
    pool = ToolWorkers(max_workers=2)
    try:
        await pool.call(whoami, {}, 30)  # started, so the measurement below is of the call alone
        with pytest.raises(ToolTimeout):
            _, gap, seconds = await loop_gaps_while(pool.call(stuck_in_c, {}, 1.0))
        out, gap, seconds = await loop_gaps_while(run_tool(ToolCall("stuck", {}), {"stuck": stuck_in_c}, 1.0))
        assert out == "error: tool 'stuck' timed out after 1 s"
        assert seconds < 4 and gap < 0.5, (seconds, gap)
    finally:
        pool.close()


async def test_the_calculator_case_answers_within_the_timeout():
    out, gap, seconds = await loop_gaps_while(
        run_tool(ToolCall("calculator", {"expression": "(((9**64)**64)**64)**64"}), {"calculator": calculator}, 2.0))
    assert out.startswith("error: ") and seconds < 3 and gap < 0.5, (out, seconds, gap)
    assert await run_tool(ToolCall("calculator", {"expression": "2**10"}), {"calculator": calculator}, 2.0) == "1024"
    with pytest.raises(ValueError, match="too large"):
        calculator("(((9**64)**64)**64)**64")


async def test_a_killed_worker_is_replaced_and_errors_come_back_as_text():
    pool = ToolWorkers(max_workers=1)
    try:
        first = await pool.call(whoami, {}, 30)
        assert await pool.call(whoami, {}, 30) == first  # reused while healthy
        with pytest.raises(ToolTimeout):
            await pool.call(stuck_in_c, {}, 0.5)
        assert await pool.call(whoami, {}, 30) != first  # a fresh worker after the kill
        with pytest.raises(ToolFailed, match="missing") as err:
            await pool.call(fails, {}, 30)
        assert err.value.kind == "KeyError"
        with pytest.raises(ToolFailed, match="died") as err:
            await pool.call(dies, {}, 30)
        with pytest.raises(ToolFailed, match="define it at module level"):
            await pool.call(lambda: "x", {}, 30)
        assert await pool.call(calculator, {"expression": "6*7"}, 30) == "42"
    finally:
        pool.close()
    assert "error: KeyError: 'missing'" == await run_tool(ToolCall("f", {}), {"f": fails}, 30)
