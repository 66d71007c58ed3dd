"""A reward computed by an HTTP reward server (a reward model, a judge, a verifier service)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample

log = logging.getLogger("posttrain.rewards.remote")
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteReward(Component):
    """POSTs ``{"prompt", "response", "label", "metadata"}`` as JSON to ``url``; the server answers with a
    number or a JSON object holding ``score_key`` (other numeric fields are kept as extras).

    Each attempt has ``timeout`` seconds; connection errors, timeouts and HTTP 408/429/5xx are retried
    ``retries`` times after ``backoff * 2**attempt`` seconds (capped at ``backoff_max``, with full jitter).
    Other HTTP errors and unparseable answers are not retried. After the last attempt the sample gets
    ``failure_reward`` and ``failed = 1`` (the runner logs the mean as ``reward/remote/failed``), or,
    with ``on_error: raise``, the error propagates and the reward runner decides (it marks the sample
    failed, or stops the run when its own ``on_error`` is ``raise``). At most ``concurrency`` requests
    are in flight per reward instance. Returns ``{"score", "failed", ...server extras}``.
    """

    name = "remote"
    scope = "sample"

    @dataclass
    class Config:
        url: str = option("", help="reward server endpoint, e.g. http://127.0.0.1:8000/reward")
        timeout: float = option(30.0, gt=0.0, help="seconds per attempt")
        retries: int = option(3, ge=0, help="retries after the first attempt")
        backoff: float = option(0.5, ge=0.0, help="first retry delay (s); doubles per attempt")
        backoff_max: float = option(8.0, ge=0.0)
        concurrency: int = option(32, ge=1, help="requests in flight at once")
        score_key: str = option("score", help="key of the score in the server's JSON answer")
        on_error: Literal["failure_reward", "raise"] = option("failure_reward")
        failure_reward: float = option(0.0, help="score given when every attempt failed")
        headers: dict[str, str] = option(default_factory=dict, help="extra HTTP headers (e.g. authorization)")

        def validate(self) -> list[str]:
            if not self.url.startswith(("http://", "https://")):
                return [f"url: expected an http(s):// URL, got {self.url!r}"]
            return []

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self.failures = 0  # samples that got failure_reward (over the instance's life)
        self._session = None
        self._loop = None
        self._semaphore: asyncio.Semaphore | None = None

    def _client(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.config.headers)
            self._semaphore = asyncio.Semaphore(self.config.concurrency)
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session (the reward runner calls this when it closes)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def payload(self, sample: Sample) -> dict[str, Any]:
        return {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                "metadata": sample.metadata}

    def parse(self, body: Any) -> dict[str, float]:
        if isinstance(body, (int, float)) and not isinstance(body, bool):
            return {"score": float(body)}
        if isinstance(body, dict) and isinstance(body.get(self.config.score_key), (int, float)):
            extras = {k: float(v) for k, v in body.items() if k != self.config.score_key
                      and isinstance(v, (int, float)) and not isinstance(v, bool)}
            return {**extras, "score": float(body[self.config.score_key])}
        raise ValueError(f"the reward server answered {json.dumps(body)[:80]}, expected a number or an "
                         f"object with {self.config.score_key!r}")

    async def __call__(self, sample: Sample) -> dict[str, float]:
        import aiohttp

        c = self.config
        if not c.url:  # run configs reject this at validation; direct use gets the failure path at once
            return self._failed(sample, "no url configured", attempts=0)
        session = self._client()
        data = json.dumps(self.payload(sample), default=str)
        last = "no attempt made"
        for attempt in range(c.retries + 1):
            if attempt:
                await asyncio.sleep(random.uniform(0, min(c.backoff_max, c.backoff * 2 ** (attempt - 1))))
            try:
                async with self._semaphore:
                    async with session.post(c.url, data=data, headers={"Content-Type": "application/json"},
                                            timeout=aiohttp.ClientTimeout(total=c.timeout)) as resp:
                        text = await resp.text()
                        status = resp.status
                if status in RETRY_STATUS:
                    last = f"HTTP {status}: {text[:80]}"
                    continue
                if status >= 400:
                    last = f"HTTP {status}: {text[:80]}"
                    break
                result = self.parse(json.loads(text))
                return {**result, "failed": 0.0}
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} after {c.timeout}s"
            except ValueError as exc:  # unparseable answer: retrying will not fix the server
                last = str(exc)
                break
        return self._failed(sample, last, attempt + 1)

    def _failed(self, sample: Sample, why: str, attempts: int) -> dict[str, float]:
        message = f"{self.config.url or 'remote'} failed for sample {sample.index} after {attempts} attempt(s): {why}"
        if self.config.on_error == "raise":
            raise RuntimeError(message)
        self.failures += 1
        log.warning(message)
        return {"score": self.config.failure_reward, "failed": 1.0}


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(RemoteReward)
