"""One ``/generate`` for many: the token-id requests that rollouts make in the same event-loop turn go to
the engine as one batched request (SGLang's list ``input_ids`` with one ``sampling_params`` per row), and
every caller gets its own rows back, in the shape it asked for::

    engine = CoalescingEngine(client, max_rows=1024, seed_rows=True)
    # 64 groups' POST /generate of 16 rows each, made in one turn: one request of 1,024 rows

``rollout.coalesce_rows`` turns it on (the loop wraps the run's client). Each request stays what it was:

- rows keep their sampling: a row's ``sampling_params`` goes with it; a batch sharing one seeded
  ``sampling_params`` becomes rows seeded ``seed + j`` (the rule of engines that seed by row,
  ``seed_rows``; without it such a batch is sent alone, as is anything with a ``rid``, ``text``, a
  per-row ``logprob_start_len`` or a part bigger than ``max_rows``);
- only requests with the same other fields (``return_logprob``, ...) are merged;
- a request merged with nobody is sent exactly as it was made; a merged one goes as JSON bytes (orjson)
  when its floats are finite, else as the object, which the client encodes (NaN reaches the server);
- a caller cancelled while its request is merged just stops waiting; the merged request is cancelled
  (and the engine aborts its rows) once all of its callers are gone;
- an HTTP 4xx answer to a merged request sends each part again alone, so only the bad one fails; any
  other failure reaches every part.

A merged answer returns only when all of its rows are done: a long-tailed generation would make short
groups wait on the slowest. It pays where every row ends together (one-token answers, CPU runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from posttrain.core import jsonio
from posttrain.core.rollout.client import EngineClient, EngineRequestError
from posttrain.core.types import row_seed

_ROW_KEYS = ("input_ids", "sampling_params")  # what a merged request takes from each part, row by row
_ALONE_KEYS = ("text", "rid", "image_data")  # a part carrying these is sent as it is (image_data: per row, not merged)


@dataclass
class _Part:
    """One caller's request: ``rows`` prompts (``[n]`` lists of ids), their ``params`` (``[n]`` dicts, or
    None: the request's shared unseeded dict ``shared`` for every row), and its answer's ``future``."""

    payload: dict[str, Any]
    rows: list[list[int]]
    batched: bool
    shared: dict[str, Any] | None
    params: list[dict[str, Any]] | None
    future: asyncio.Future = field(default=None)


class CoalescingEngine:
    """An :class:`EngineClient` (or a wrapper of one) whose ``POST /generate`` calls made in one event-loop
    turn are merged into requests of at most ``max_rows`` rows. ``seed_rows``: the engines seed row ``j``
    of a batch sharing one seeded ``sampling_params`` with ``seed + j``. ``merged``: merged requests sent,
    ``parts``: the requests they carried (both for tests and metrics)."""

    def __init__(self, client: Any, max_rows: int, seed_rows: bool = False):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._client = client
        self.max_rows, self.seed_rows = max_rows, seed_rows
        self._waiting: dict[tuple, list[_Part]] = {}
        self._flushing = False
        self._tasks: set[asyncio.Task] = set()
        self.merged = self.parts = 0

    def __getattr__(self, name: str) -> Any:  # every other EngineClient method, unchanged
        return getattr(self._client, name)

    generate = EngineClient.generate  # builds the body and calls self.request

    async def close(self) -> None:
        pass  # the wrapped client belongs to the caller

    async def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        part = _part(payload, self.seed_rows, self.max_rows) if method == "POST" and path == "/generate" else None
        if part is None:
            return await self._client.request(method, path, payload)
        loop = asyncio.get_running_loop()
        part.future = loop.create_future()
        self._waiting.setdefault(_key(payload), []).append(part)
        if not self._flushing:
            self._flushing = True
            loop.call_soon(self._flush)  # after every rollout that is ready in this turn has asked
        return await part.future  # a cancelled caller cancels its future: the flush skips it

    def _flush(self) -> None:
        self._flushing = False
        waiting, self._waiting = self._waiting, {}
        for parts in waiting.values():
            batch: list[_Part] = []
            rows = 0
            for part in parts:
                if part.future.done():  # cancelled before it was sent
                    continue
                if batch and rows + len(part.rows) > self.max_rows:
                    self._send(batch)
                    batch, rows = [], 0
                batch.append(part)
                rows += len(part.rows)
            if batch:
                self._send(batch)

    def _send(self, batch: list[_Part]) -> None:
        task = asyncio.ensure_future(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        live = [len(batch)]

        def gone(fut: asyncio.Future) -> None:  # the last caller gone cancels the request
            if fut.cancelled():
                live[0] -= 1
                if live[0] == 0:
                    task.cancel()

        for part in batch:
            part.future.add_done_callback(gone)

        def ended(task: asyncio.Task) -> None:  # cancelled from outside (the loop shutting down): so are they
            if task.cancelled():
                for part in batch:
                    part.future.cancel()

        task.add_done_callback(ended)

    async def _run(self, batch: list[_Part]) -> None:
        if len(batch) == 1:
            await self._answer(batch[0], self._client.request("POST", "/generate", batch[0].payload))
            return
        self.merged += 1
        self.parts += len(batch)
        rows = sum(len(p.rows) for p in batch)
        try:
            outs = await self._client.request("POST", "/generate", _encoded(batch))
            if not isinstance(outs, list) or len(outs) != rows:
                raise EngineRequestError("/generate", 500, f"a merged request of {rows} rows got "
                                                           f"{type(outs).__name__} back")
        except EngineRequestError as err:
            if err.status >= 500:
                return _fail(batch, err)
            # one part was refused: each goes again alone, and only the bad one fails
            await asyncio.gather(*[self._answer(p, self._client.request("POST", "/generate", p.payload))
                                   for p in batch if not p.future.done()])
            return
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - every caller sees the request's failure
            return _fail(batch, err)
        start = 0
        for part in batch:
            rows = outs[start:start + len(part.rows)]
            start += len(part.rows)
            if not part.future.done():
                part.future.set_result(rows if part.batched else rows[0])

    @staticmethod
    async def _answer(part: _Part, call: Any) -> None:
        try:
            out = await call
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001
            if not part.future.done():
                part.future.set_exception(err)
            return
        if not part.future.done():
            part.future.set_result(out)


def _fail(batch: list[_Part], err: BaseException) -> None:
    for part in batch:
        if not part.future.done():
            part.future.set_exception(err)


def _key(payload: dict[str, Any]) -> tuple:
    """The fields besides the rows: requests merge only when these are equal."""
    return tuple(sorted((k, repr(v)) for k, v in payload.items() if k not in _ROW_KEYS))


def _part(payload: Any, seed_rows: bool, max_rows: int) -> _Part | None:
    """``payload`` as a part to merge, or None when it must go alone."""
    if not isinstance(payload, dict) or any(payload.get(k) is not None for k in _ALONE_KEYS):
        return None
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or isinstance(payload.get("logprob_start_len"), list):
        return None
    batched = isinstance(ids[0], list)
    rows = ids if batched else [ids]
    if len(rows) > max_rows:
        return None
    sp = payload.get("sampling_params")
    if isinstance(sp, list):
        if not batched or len(sp) != len(rows) or not all(isinstance(s, dict) for s in sp):
            return None
        return _Part(payload, rows, batched, None, sp)
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        return None
    seed = sp.get("sampling_seed")
    if seed is None:
        return _Part(payload, rows, batched, sp, None)
    if not batched:
        return _Part(payload, rows, batched, None, [sp])
    if not seed_rows or not isinstance(seed, int):
        return None  # the engines' own rule for a shared seed is not known here
    return _Part(payload, rows, batched, None, [{**sp, "sampling_seed": row_seed(seed, j)} for j in range(len(rows))])


def _encoded(batch: list[_Part]) -> dict[str, Any] | bytes:
    """:func:`_merged`, encoded at once (orjson: a thousand rows' body in ~0.1 ms instead of ~3) when
    every part's fields are finite, checked part by part (a NaN must reach the server as written)."""
    body = _merged(batch)
    if all(jsonio.finite({k: v for k, v in p.payload.items() if k != "input_ids"}) for p in batch):
        return jsonio.dumps_finite(body)
    return body


def _merged(batch: list[_Part]) -> dict[str, Any]:
    """One body for every part of ``batch``: their rows in order, one shared ``sampling_params`` when all
    parts share one unseeded dict, else one per row."""
    body = {k: v for k, v in batch[0].payload.items() if k not in _ROW_KEYS}
    body["input_ids"] = [row for part in batch for row in part.rows]
    first = batch[0].shared
    if first is not None and all(p.shared == first for p in batch):
        body["sampling_params"] = first
    else:
        body["sampling_params"] = [sp for p in batch for sp in (p.params or [p.shared] * len(p.rows))]
    return body
