"""The async client of SGLang's native HTTP API: the only way generators talk to engines.

It works against a real SGLang server, sglang-router, or posttrain's local engine alike::

    async with EngineClient("http://127.0.0.1:30000") as engine:
        out = await engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 16})
        out["output_ids"], out["meta_info"]["output_token_logprobs"]   # [[logprob, token_id, None], ...]

Token in, token out: :func:`tokens_and_logprobs` reads the response's tokens and log-probs from
``meta_info.output_token_logprobs`` (falling back to ``output_ids``), never by re-tokenizing ``text``.

Connection errors (refused, reset, server disconnected) are retried with exponential backoff up to
``max_retries`` times; HTTP 4xx answers raise :class:`EngineRequestError` at once (a bad request stays
bad); 5xx answers are retried. At most ``max_concurrency`` requests are in flight per client.
``api_key``: sent as ``Authorization: Bearer KEY`` on every call (the run's engines and router need it).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from posttrain.core import jsonio
from posttrain.core.watchdog import waiting_on


class EngineRequestError(RuntimeError):
    """The engine answered with an HTTP error; ``status`` and the server's ``message`` are kept."""

    def __init__(self, url: str, status: int, message: str):
        self.url, self.status, self.message = url, status, message
        super().__init__(f"{url}: HTTP {status}: {message}")


class EngineClient:
    """Async SGLang-protocol client bound to one base URL (an engine or a router)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, max_retries: int = 3, max_concurrency: int = 512,
                 backoff_s: float = 0.2, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key  # generators that serve their own endpoints (openai_agent) require the same key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Future] = set()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # sessions belong to one event loop; a client reused from another loop gets a fresh one
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self._headers,
                                                  connector=aiohttp.TCPConnector(limit=self.max_concurrency))
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop

    async def request(self, method: str, path: str, payload: dict[str, Any] | bytes | None = None) -> Any:
        """One call with retries; returns decoded JSON (or the text, or ``None`` for an empty body).
        ``payload``: a JSON-able object, or ``bytes`` already encoded as JSON, sent as they are."""
        self._ensure()
        url = self.base_url + path
        async with self._sem:
            with waiting_on("engine", f"{method} {url}", blocking=False):  # bounded: timeout_s per attempt, max_retries
                return await self._attempts(method, url, payload)

    async def _attempts(self, method: str, url: str, payload: dict[str, Any] | bytes | None) -> Any:
        attempt = 0
        while True:
            attempt_task = asyncio.ensure_future(self._attempt(method, url, payload, attempt))
            self._inflight.add(attempt_task)
            try:
                return await attempt_task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling() or not attempt_task.cancelled():
                    raise  # our caller cancelled us: not an interrupt
                exc: BaseException = _Retry("interrupted: the engine serving it died")
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, _Retry) as err:
                exc = err
            finally:
                self._inflight.discard(attempt_task)
            if attempt >= self.max_retries:
                raise ConnectionError(f"{url}: {exc!r} after {attempt + 1} attempt(s)") from exc
            await asyncio.sleep(self.backoff_s * (2 ** attempt) * (1 + random.random()))
            attempt += 1

    async def _attempt(self, method: str, url: str, payload: dict[str, Any] | None, attempt: int) -> Any:
        if isinstance(payload, bytes):  # a body encoded once by the caller (a merged /generate)
            kwargs: dict[str, Any] = {"data": payload, "headers": {"Content-Type": "application/json"}}
        else:
            kwargs = {"json": payload}
        async with self._session.request(method, url, **kwargs) as resp:
            body = await resp.text()
            if resp.status >= 500 and attempt < self.max_retries:
                raise _Retry(f"HTTP {resp.status}: {body[:200]}")
            if resp.status >= 400:
                raise EngineRequestError(url, resp.status, _message(body))
            if not body:
                return None
            if "json" in resp.headers.get("Content-Type", ""):
                return jsonio.loads(body)
            return body

    def interrupt(self) -> int:
        """Cancel every request in flight and send it again (an engine behind the router died with them:
        a router keeps waiting on a dead worker's connection). Call it in this client's event loop
        after the dead engine left the router. Returns how many were resent."""
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        return len(tasks)

    # -- generation -----------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | None = None, text: str | None = None,
                       sampling_params: Any = None, return_logprob: bool = True,
                       rid: str | None = None, **extra: Any) -> dict[str, Any]:
        """``POST /generate`` for one prompt; returns ``{text, output_ids, meta_info}``.

        ``sampling_params`` is SGLang's mapping or a :class:`~posttrain.core.types.SamplingParams`.
        """
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        if hasattr(sampling_params, "to_sglang"):
            sampling_params = sampling_params.to_sglang()
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:
            payload["input_ids"] = list(input_ids)
        else:
            payload["text"] = text
        if rid is not None:
            payload["rid"] = rid
        payload.update(extra)
        return await self.request("POST", "/generate", payload)

    async def health_generate(self) -> bool:
        """True when the server answers ``/health_generate`` with 200 (no retries)."""
        self._ensure()
        try:
            async with self._session.get(self.base_url + "/health_generate") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def flush_cache(self) -> Any:
        return await self.request("GET", "/flush_cache")

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> Any:
        return await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> Any:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    async def get_model_info(self) -> dict[str, Any]:
        return await self.request("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self.request("GET", "/get_server_info")

    async def get_weight_version(self) -> str:
        return (await self.request("GET", "/get_weight_version"))["weight_version"]

    # -- weights --------------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        return await self.request("POST", "/update_weights_from_disk",
                                  {"model_path": model_path, "weight_version": weight_version})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        return await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None) -> dict[str, Any]:
        return await self.request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """Free GPU memory (``tags``: ``weights``, ``kv_cache``; default both) while a colocated trainer runs."""
        return await self.request("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})


class _Retry(Exception):
    pass


def _message(body: str) -> str:
    import json

    try:
        data = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return body.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return body.strip()[:500]


def tokens_and_logprobs(response: dict[str, Any]) -> tuple[list[int], list[float] | None]:
    """The generated token ids and their log-probs from a ``/generate`` answer (no re-tokenization)."""
    meta = response.get("meta_info", {})
    lps = meta.get("output_token_logprobs")
    if lps:
        return [int(t[1]) for t in lps], [float(t[0]) for t in lps]
    return list(response.get("output_ids") or []), None


def weight_version_int(response: dict[str, Any]) -> int:
    """``meta_info.weight_version`` as an int (SGLang's default ``"default"`` counts as 0)."""
    v = str(response.get("meta_info", {}).get("weight_version", "0"))
    return int(v) if v.lstrip("-").isdigit() else 0
