"""Reward execution: weighted composition, async concurrency, a process pool, contained failures.

The run config's ``rewards:`` list selects the parts; ``reward_runner:`` sets how they run::

    rewards:
      - {name: math, weight: 1.0}
      - {name: overlong, weight: 1.0, max_len: 4096, buffer: 512}
    reward_runner: {workers: 2, concurrency: 64, on_error: mark_failed, timeout: 60}

For every scoreable sample (status not ``failed``/``aborted``) and every part ``k`` with weight
``w_k``: ``sample.reward = sum_k w_k * score_k``; ``sample.reward_parts[k] = score_k`` plus
``"k/<key>"`` for every extra named float a part returns (``math/format_ok``). A part listed twice is
named ``k``, ``k#2``, ... . How parts run:

- ``async def __call__``: concurrently, at most ``concurrency`` calls in flight over all parts, each
  cancelled after ``timeout`` seconds when set;
- sync, ``workers > 1``: in a pool of ``workers`` spawned processes, samples sent in chunks (CPU-bound
  rewards such as math-verify then use several cores and a hung parse cannot block the event loop);
- sync, ``workers == 1``: inline, yielding to the event loop between samples.

A part that raises, returns NaN/inf, or returns the wrong shape marks that sample ``FAILED`` with
``sample.error`` (``reward <name>: <message>``) and ``sample.reward = None``; it is logged with the
sample's index and counted in ``reward/failed``. With ``on_error="raise"`` the first failure raises
:class:`RewardError` instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.core.errors import UsageError
from posttrain.core.schema import option
from posttrain.core.types import Sample, SampleStatus
from posttrain.core.watchdog import waiting_on

log = logging.getLogger("posttrain.rewards")

SKIPPED = (SampleStatus.FAILED, SampleStatus.ABORTED)


class RewardError(RuntimeError):
    """A reward failed and ``on_error`` is ``raise``: the run stops with this message."""


@dataclass
class RewardRunnerConfig:
    """How rewards run (the run config's ``reward_runner:`` section)."""

    workers: int = option(1, ge=1, help="processes for sync rewards; 1 runs them in the main process")
    concurrency: int = option(64, ge=1, help="async reward calls in flight at once")
    on_error: Literal["mark_failed", "raise"] = option(
        "mark_failed", help="a failing reward marks the sample failed, or stops the run")
    timeout: float | None = option(None, gt=0.0, help="seconds per async reward call; a call past it fails "
                                                      "the sample (null: no limit)")


@dataclass
class _RewardPart:
    label: str  # the name in reward_parts and metrics
    name: str
    weight: float
    reward: Any
    scope: str
    is_async: bool


def normalize_result(result: Any, label: str) -> dict[str, float]:
    """A reward's return value as ``{"score": float, **extras}``; raises ValueError when it is not a
    finite float or a dict of finite floats with the key ``"score"``."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without the key 'score' (keys: {sorted(result)})")
        out = {}
        for key, value in result.items():
            out[str(key)] = _finite(value, f"[{key!r}]")
        return out
    return {"score": _finite(result, "")}


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # numpy and torch scalars
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"returned{where} {value!r}, not a number") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned{where} {value}, not a finite number")
    return value


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---- worker-process side (module-level so spawned workers can import them) ----
_WORKER_REWARDS: dict[str, Any] = {}


def _init_worker(payload: bytes) -> None:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER_REWARDS.update(pickle.loads(payload))
    for reward in _WORKER_REWARDS.values():  # pay lazy imports (sympy, ...) before the first batch
        warm = getattr(reward, "warm_up", None)
        if callable(warm):
            warm()


def _worker_pid(hold: float) -> int:
    time.sleep(hold)
    return __import__("os").getpid()


def _run_chunk(label: str, units: list) -> list[tuple[bool, Any]]:
    reward = _WORKER_REWARDS[label]
    out = []
    for unit in units:
        try:
            out.append((True, reward(unit)))
        except Exception as exc:  # contained: reported per sample by the parent
            out.append((False, _describe(exc)))
    return out


def _light(sample: Sample) -> Sample:
    """A copy without the per-token lists no reward needs (cheaper to pickle)."""
    return dataclasses.replace(sample, rollout_log_probs=None, loss_mask=None, rollout_routed_experts=None)


class RewardRunner:
    """Scores groups of samples with the configured reward parts. See the module docstring.

    :param components: ``Selection`` s of kind ``rewards`` (``.name``, ``.weight``, ``.create(plugins)``).
    :param plugins: the ``Plugins`` the components are built from.
    """

    def __init__(self, components: list, plugins: Any, workers: int = 1, concurrency: int = 64,
                 on_error: str = "mark_failed", timeout: float | None = None):
        if on_error not in ("mark_failed", "raise"):
            raise UsageError(f"reward_runner.on_error: expected mark_failed or raise, got {on_error!r}")
        if workers < 1 or concurrency < 1:
            raise UsageError("reward_runner: workers and concurrency must be >= 1")
        self.workers, self.concurrency, self.on_error, self.timeout = workers, concurrency, on_error, timeout
        self.parts: list[_RewardPart] = []
        seen: dict[str, int] = defaultdict(int)
        for comp in components:
            seen[comp.name] += 1
            label = comp.name if seen[comp.name] == 1 else f"{comp.name}#{seen[comp.name]}"
            reward = comp.create(plugins)
            scope = getattr(reward, "scope", "sample")
            if scope not in ("sample", "group"):
                raise UsageError(f"reward {comp.name!r}: scope must be 'sample' or 'group', got {scope!r}")
            is_async = inspect.iscoroutinefunction(getattr(type(reward), "__call__", None)) or \
                inspect.iscoroutinefunction(reward)
            self.parts.append(_RewardPart(label, comp.name, float(comp.weight), reward, scope, is_async))
        self._pool = None
        self._semaphore: asyncio.Semaphore | None = None
        self._semaphore_loop = None

    @classmethod
    def from_config(cls, config: Any, plugins: Any) -> RewardRunner:
        """From a ``RunConfig`` (its ``rewards`` list and ``reward_runner`` section)."""
        rc = getattr(config, "reward_runner", None) or RewardRunnerConfig()
        return cls(config.rewards, plugins, workers=rc.workers, concurrency=rc.concurrency, on_error=rc.on_error,
                   timeout=rc.timeout)

    # ---- the process pool ----
    def _sync_pool_parts(self) -> list[_RewardPart]:
        return [p for p in self.parts if not p.is_async] if self.workers > 1 else []

    def _get_pool(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            rewards = {p.label: p.reward for p in self._sync_pool_parts()}
            try:
                payload = pickle.dumps(rewards)
            except Exception as exc:
                raise UsageError(f"reward_runner.workers={self.workers}: a reward cannot be sent to worker "
                                 f"processes ({_describe(exc)}); install it as a package or use workers: 1") from None
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(payload,))
        return self._pool

    def close(self) -> None:
        """Shut the worker processes down (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> RewardRunner:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the worker pool and every reward that holds connections (an ``aclose()`` coroutine)."""
        for part in self.parts:
            closer = getattr(part.reward, "aclose", None)
            if closer is not None:
                await closer()
        self.close()

    def warm_up(self) -> None:
        """Start the worker processes now and call each reward's optional ``warm_up()`` (here and in
        every worker), so lazy imports are not paid by the first batch."""
        for part in self.parts:
            warm = getattr(part.reward, "warm_up", None)
            if callable(warm) and not (self.workers > 1 and not part.is_async):
                warm()
        if self._sync_pool_parts():
            pool = self._get_pool()
            pids: set[int] = set()
            for _ in range(10):  # the executor starts processes on demand: keep them all busy at once
                pids |= {f.result() for f in [pool.submit(_worker_pid, 0.05) for _ in range(self.workers)]}
                if len(pids) >= self.workers:
                    break

    # ---- scoring ----
    async def score_groups(self, groups: list[list[Sample]]) -> dict[str, float]:
        """Score every scoreable sample of ``groups`` in place; return the metrics.

        Metrics: ``reward/<name>`` (mean score of that part), ``reward/<name>/<key>`` (mean of its
        extras), ``reward/total`` (mean weighted sum), ``reward/failed`` (samples that failed here),
        ``reward/seconds``.
        """
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore_loop is not loop:  # one per event loop
            self._semaphore, self._semaphore_loop = asyncio.Semaphore(self.concurrency), loop
        eligible = [[s for s in g if s.status not in SKIPPED] for g in groups]
        # (part label, id(sample)) -> (ok, normalized dict | error message)
        results: dict[tuple[str, int], tuple[bool, Any]] = {}
        waits = []
        inline = []
        for part in self.parts:
            units = [g for g in eligible if g] if part.scope == "group" else [s for g in eligible for s in g]
            if not units:
                continue
            if part.is_async:
                waits += [self._call_async(part, u, results) for u in units]
            elif self.workers > 1:
                waits.append(self._call_pool(part, units, results))
            else:
                inline.append((part, units))
        tasks = [asyncio.ensure_future(w) for w in waits]
        yielded = time.perf_counter()
        for part, units in inline:
            for unit in units:
                self._store(part, unit, self._call_sync(part, unit), results)
                if time.perf_counter() - yielded > 0.002:  # let async parts and the rest of the loop progress
                    await asyncio.sleep(0)  # (every 2 ms, not per sample: a yield costs more than a cheap reward)
                    yielded = time.perf_counter()
        if tasks:
            await asyncio.gather(*tasks)
        return self._combine(eligible, results, time.perf_counter() - start)

    def _call_sync(self, part: _RewardPart, unit) -> tuple[bool, Any]:
        try:
            with waiting_on("reward", part.label):  # a sync call cannot be cut short: watchdog.stall_s bounds it
                return True, part.reward(unit)
        except Exception as exc:
            return False, _describe(exc)

    async def _call_async(self, part: _RewardPart, unit, results) -> None:
        async with self._semaphore:
            try:
                with waiting_on("reward", part.label, blocking=False):  # bounded by reward_runner.timeout when set
                    out = (True, await asyncio.wait_for(part.reward(unit), self.timeout))
            except asyncio.TimeoutError:
                out = (False, f"timed out after {self.timeout}s (reward_runner.timeout)")
            except Exception as exc:
                out = (False, _describe(exc))
        self._store(part, unit, out, results)

    async def _call_pool(self, part: _RewardPart, units: list, results) -> None:
        from concurrent.futures.process import BrokenProcessPool

        loop = asyncio.get_running_loop()
        pool = self._get_pool()
        size = max(1, min(256, -(-len(units) // (self.workers * 4))))
        chunks = [units[i:i + size] for i in range(0, len(units), size)]
        light = [[[_light(s) for s in u] if part.scope == "group" else _light(u) for u in c] for c in chunks]
        futures = [loop.run_in_executor(pool, _run_chunk, part.label, c) for c in light]
        for chunk, payload, fut in zip(chunks, light, futures):
            try:
                with waiting_on("reward", f"{part.label} (a chunk of {len(chunk)} in the worker pool)", blocking=False):
                    outs = await fut
            except BrokenProcessPool:
                # a worker died (os._exit, a native crash, the OOM killer) and took the pool down: retry
                # this chunk once on a fresh pool, so only the chunk that kills workers fails
                outs = await self._retry_chunk(part, payload, pool)
            for unit, out in zip(chunk, outs):
                self._store(part, unit, out, results)

    async def _retry_chunk(self, part: _RewardPart, payload: list, broken) -> list[tuple[bool, Any]]:
        from concurrent.futures.process import BrokenProcessPool

        if self._pool is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        pool = self._get_pool()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _run_chunk, part.label, payload)
        except BrokenProcessPool:
            if self._pool is pool:
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            return [(False, "the worker process died while scoring this sample's chunk")] * len(payload)

    def _store(self, part: _RewardPart, unit, out: tuple[bool, Any], results) -> None:
        ok, value = out
        if part.scope == "group":
            if ok and (not isinstance(value, (list, tuple)) or len(value) != len(unit)):
                ok, value = False, f"group reward returned {type(value).__name__} of length " \
                                   f"{len(value) if isinstance(value, (list, tuple)) else '-'} for {len(unit)} samples"
            for i, sample in enumerate(unit):
                results[part.label, id(sample)] = self._check(part, value[i] if ok else value, ok)
        else:
            results[part.label, id(unit)] = self._check(part, value, ok)

    @staticmethod
    def _check(part: _RewardPart, value, ok: bool) -> tuple[bool, Any]:
        if not ok:
            return False, value
        try:
            return True, normalize_result(value, part.label)
        except ValueError as exc:
            return False, str(exc)

    def _combine(self, eligible: list[list[Sample]], results, seconds: float) -> dict[str, float]:
        sums: dict[str, list[float]] = defaultdict(list)
        totals, failed = [], 0
        for group in eligible:
            for sample in group:
                total, errors = 0.0, []
                for part in self.parts:
                    ok, value = results.get((part.label, id(sample)), (False, "not scored"))
                    if not ok:
                        errors.append(f"reward {part.label}: {value}")
                        continue
                    sample.reward_parts[part.label] = value["score"]
                    sums[f"reward/{part.label}"].append(value["score"])
                    for key, v in value.items():
                        if key != "score":
                            sample.reward_parts[f"{part.label}/{key}"] = v
                            sums[f"reward/{part.label}/{key}"].append(v)
                    total += part.weight * value["score"]
                if errors:
                    failed += 1
                    sample.status, sample.error, sample.reward = SampleStatus.FAILED, "; ".join(errors), None
                    message = f"sample {sample.index} (group {sample.group_index}): {sample.error}"
                    if self.on_error == "raise":
                        raise RewardError(message)
                    log.warning(message)
                else:
                    sample.reward = total
                    totals.append(total)
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        if totals:
            metrics["reward/total"] = sum(totals) / len(totals)
        metrics["reward/failed"] = float(failed)
        metrics["reward/seconds"] = seconds
        return metrics


def reward_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    """Reward metrics of a finished batch, from what :meth:`RewardRunner.score_groups` stored on the
    samples: ``reward/<part>`` means of ``sample.reward_parts``, ``reward/total``, ``reward/failed``
    (when dynamic sampling scores group by group, the loop reports these over the kept batch)."""
    sums: dict[str, list[float]] = defaultdict(list)
    totals, failed = [], 0
    for group in groups:
        for s in group:
            if s.status == SampleStatus.FAILED:
                failed += 1
                continue
            for key, value in s.reward_parts.items():
                sums[f"reward/{key}"].append(value)
            if s.reward is not None:
                totals.append(s.reward)
    metrics = {k: sum(v) / len(v) for k, v in sums.items()}
    if totals:
        metrics["reward/total"] = sum(totals) / len(totals)
    metrics["reward/failed"] = float(failed)
    return metrics
