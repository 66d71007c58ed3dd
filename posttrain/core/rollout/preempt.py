"""Weight pushes in the middle of generation: pause the engines, load the weights, continue the requests.

:class:`PausableEngine` wraps the run's :class:`~posttrain.core.rollout.client.EngineClient` (it is handed
to generators in its place: same methods). :meth:`PausableEngine.paused` is the push::

    async with engine.paused():        # every engine: POST /pause_generation {"mode": "abort"}
        push the weights               # the requests in flight came back aborted, with their partial tokens
                                       # on leaving: POST /continue_generation, the requests go on

SGLang's ``pause_generation`` in ``abort`` mode answers every request in flight with finish reason
``abort`` and the tokens generated so far (their log-probs too); posttrain's local engine does the same.
A ``/generate`` answer aborted by a pause is not handed back to the generator: once generation
continues, the request is sent again,

- with ``partial`` on: as ``prompt + partial tokens`` (re-prefilled under the new weights) for the
  ``max_new_tokens`` left, and the answers are joined: ``output_ids``, ``output_token_logprobs`` (each
  token's log-prob under the weights that sampled it: the behaviour policy) and
  ``meta_info.output_token_weight_versions``, the weight version of every output token;
- with ``partial`` off: from the start, the partial tokens thrown away (every token of the answer has
  the new version).

So this works with any SGLang-protocol engine (SGLang, an ``external`` fleet, the local engine) and
with every generator: they see one answer per request. An abort that no pause caused (an engine error)
is handed back as it is.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from posttrain.core.rollout.client import EngineClient, weight_version_int
from posttrain.core.types import row_seed

VERSIONS_KEY = "output_token_weight_versions"
log = logging.getLogger("posttrain.rollout")


def token_weight_versions(response: dict[str, Any], n: int) -> list[int]:
    """The weight version of each of the ``n`` output tokens of a ``/generate`` answer: the joined answer's
    ``meta_info.output_token_weight_versions``, else ``meta_info.weight_version`` for every token."""
    versions = response.get("meta_info", {}).get(VERSIONS_KEY)
    if versions is not None and len(versions) == n:
        return [int(v) for v in versions]
    return [weight_version_int(response)] * n


def _finish(response: dict[str, Any]) -> str:
    reason = response.get("meta_info", {}).get("finish_reason") or {}
    return reason.get("type", "stop") if isinstance(reason, dict) else str(reason)


def _output(response: dict[str, Any]) -> tuple[list[int], list[Any]]:
    lps = response.get("meta_info", {}).get("output_token_logprobs")
    if lps:
        return [int(t[1]) for t in lps], list(lps)
    return list(response.get("output_ids") or []), []


def _row(payload: dict[str, Any], j: int, batched: bool) -> dict[str, Any]:
    """Row ``j`` of a (possibly batched) ``/generate`` body as a body of its own. A shared seeded
    ``sampling_params`` of a batch seeds row ``j`` with ``seed + j``, as the local engine does."""
    if not batched:
        return copy.deepcopy(payload)
    row = {k: (v[j] if isinstance(v, list) and k in ("input_ids", "text", "rid", "logprob_start_len") else v)
           for k, v in payload.items()}
    sp = payload.get("sampling_params")
    row["sampling_params"] = dict(sp[j] if isinstance(sp, list) else (sp or {}))
    seed = row["sampling_params"].get("sampling_seed")
    if seed is not None and not isinstance(sp, list):
        row["sampling_params"]["sampling_seed"] = row_seed(seed, j)
    return row


def _continued_seed(seed: int, done: int) -> int:
    """A seeded request continued after ``done`` tokens draws a fresh stream (its draws restart at step 0)."""
    digest = hashlib.blake2b(f"{seed}/continued/{done}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


class PausableEngine:
    """An :class:`EngineClient` (``client``, a router or one engine) whose ``/generate`` calls survive weight
    pushes; ``engine_urls``: every engine behind it (each is paused and continued), or a function returning
    them (asked at each pause: a restarted engine may have a new port).

    :param partial: continue an interrupted request from its partial tokens (else restart it).
    :param api_key: the engines' key.

    ``continued``: requests sent again after a pause (metric ``rollout/partial_continued``).
    """

    def __init__(self, client: EngineClient, engine_urls: list[str] | Callable[[], list[str]], partial: bool,
                 api_key: str | None = None, timeout_s: float = 300.0):
        self._client = client
        self._urls = engine_urls if callable(engine_urls) else (lambda: list(engine_urls))
        self._key, self._timeout_s = api_key, timeout_s
        self.partial = partial
        self.epoch = 0  # pauses begun
        self._pausing = False
        self._running = asyncio.Event()
        self._running.set()
        self.continued = 0

    def __getattr__(self, name: str) -> Any:  # every other EngineClient method, unchanged
        return getattr(self._client, name)

    generate = EngineClient.generate  # builds the body and calls self.request

    async def close(self) -> None:
        pass  # the wrapped client belongs to the caller

    @asynccontextmanager
    async def paused(self):
        """Pause every engine (aborting what is in flight) for the body of the ``async with``; then continue
        them and send the interrupted requests again. An engine that does not answer (it died: the push
        restarts it) is logged and skipped."""
        self.epoch += 1
        self._pausing = True
        self._running.clear()
        engines = [EngineClient(u, api_key=self._key, timeout_s=self._timeout_s, max_retries=1) for u in self._urls()]
        try:
            await self._each(engines, "pause_generation", mode="abort")
            yield
        finally:
            await self._each([EngineClient(u, api_key=self._key, timeout_s=self._timeout_s, max_retries=1)
                              for u in self._urls()], "continue_generation", close=engines)
            self._pausing = False
            self._running.set()

    @staticmethod
    async def _each(engines: list[EngineClient], method: str, close: list[EngineClient] = (), **kwargs: Any) -> None:
        results = await asyncio.gather(*[getattr(e, method)(**kwargs) for e in engines], return_exceptions=True)
        for e, r in zip(engines, results):
            if isinstance(r, BaseException):
                log.warning("%s %s: %r", e.base_url, method, r)
        for e in [*engines, *close]:
            await e.close()

    def _interrupted(self, response: Any, epoch: int) -> bool:
        return (isinstance(response, dict) and _finish(response) == "abort"
                and (self._pausing or self.epoch != epoch))

    async def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        if method != "POST" or path != "/generate" or payload is None:
            return await self._client.request(method, path, payload)
        await self._running.wait()
        epoch = self.epoch
        out = await self._client.request(method, path, payload)
        batched = isinstance(out, list)
        outs = out if batched else [out]
        if not any(self._interrupted(o, epoch) for o in outs):
            return out
        rows = [self._resume(_row(payload, j, batched), o, epoch) if self._interrupted(o, epoch) else _noop(o)
                for j, o in enumerate(outs)]
        joined = list(await asyncio.gather(*rows))
        return joined if batched else joined[0]

    async def _resume(self, body: dict[str, Any], out: dict[str, Any], epoch: int) -> dict[str, Any]:
        """Send one interrupted request again until it is not interrupted; the joined answer."""
        sp = dict(body.get("sampling_params") or {})
        budget = int(sp.get("max_new_tokens", 128))
        prompt = body.get("input_ids")
        partial = self.partial and prompt is not None  # a text prompt restarts (no token ids to extend)
        ids, lps, versions, text = [], [], [], ""
        while self._interrupted(out, epoch):
            new_ids, new_lps = _output(out)
            if partial:
                ids, lps, text = ids + new_ids, lps + new_lps, text + out.get("text", "")
                versions += [weight_version_int(out)] * len(new_ids)
            left = budget - len(ids)
            if left <= 0:  # the pause came with the last token
                out = {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": "length", "length": budget}}}
                break
            await self._running.wait()
            again = {**body, "sampling_params": {**sp, "max_new_tokens": left}}
            if partial and ids:
                again["input_ids"] = list(prompt) + ids
                if sp.get("min_new_tokens"):
                    again["sampling_params"]["min_new_tokens"] = max(0, int(sp["min_new_tokens"]) - len(ids))
                if sp.get("sampling_seed") is not None:
                    again["sampling_params"]["sampling_seed"] = _continued_seed(int(sp["sampling_seed"]), len(ids))
            self.continued += 1
            epoch = self.epoch
            out = await self._client.request("POST", "/generate", again)
        if not ids:
            return out
        last_ids, last_lps = _output(out)
        meta = dict(out.get("meta_info", {}))
        meta.update(prompt_tokens=len(prompt), completion_tokens=len(ids) + len(last_ids))
        meta[VERSIONS_KEY] = versions + [weight_version_int(out)] * len(last_ids)
        if lps or last_lps:
            meta["output_token_logprobs"] = lps + last_lps
        return {**out, "text": text + out.get("text", ""), "output_ids": ids + last_ids, "meta_info": meta}


async def _noop(value: Any) -> Any:
    return value
