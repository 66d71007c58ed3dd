"""Tool calls in model output and running tools for multi-turn generators (no heavy imports).

The default format is Qwen's / Hermes': ``<tool_call>{"name": "my_tool", "arguments": {...}}</tool_call>``.
A parser is a function ``text -> list[ToolCall]``; :data:`PARSERS` maps names to parsers (plugins may add
their own). Tools are plain callables (sync or async) taking the call's arguments as keywords and
returning a string; :func:`run_tool` applies a timeout and turns every failure into error text for the
model instead of an exception. Sync tools run in worker processes (:mod:`.tool_workers`), killed at the
timeout, so one stuck in C code never blocks the event loop; async tools run on the loop and must await.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # a malformed call: reported back to the model


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block in ``text`` (malformed JSON becomes an error call)."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block.strip())
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("expected {\"name\": ..., \"arguments\": {...}}")
            args = obj.get("arguments") or {}
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be an object")
            calls.append(ToolCall(obj["name"], args))
        except (json.JSONDecodeError, ValueError) as exc:
            calls.append(ToolCall("", {}, f"malformed tool call: {exc}"))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


async def run_tool(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout_s: float) -> str:
    """The tool's answer as text; unknown tools, exceptions and timeouts become ``error: ...`` text."""
    if call.error:
        return f"error: {call.error}"
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or '(none)'}"
    from posttrain.core.rollout.tool_workers import ToolFailed, ToolTimeout, default_workers

    from posttrain.core.watchdog import waiting_on

    try:
        with waiting_on("tool", call.name, blocking=False):
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
                result = await asyncio.wait_for(fn(**call.arguments), timeout_s)
            else:
                result = await default_workers().call(fn, call.arguments, timeout_s)
    except (asyncio.TimeoutError, ToolTimeout):
        return f"error: tool {call.name!r} timed out after {timeout_s:g} s"
    except ToolFailed as exc:  # raised in the worker: its type name and message
        return f"error: {exc.kind}: {exc}"
    except Exception as exc:  # the model sees the failure and may try again
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result)
