"""The engines of a run and the router in front of them: started, watched and restarted here, whatever
engine backend (``rollout.engine``) describes them.

::

    backend = cfg.rollout.engine.create(plugins)     # an EngineBackend (local, sglang, external, ...)
    fleet = EngineFleet(cfg.rollout, cfg.resources, backend, model_path="/ckpt/hf", log_dir=run_dir / "logs").start()
    async with fleet.client() as engine:            # EngineClient on the router (or the single engine)
        samples = await generator(group, engine, sampling)
    sender = fleet.weight_sender(backend="gloo")     # trainer side of weight updates (see weight_sync)
    fleet.check_and_restart()                        # restart dead engines, re-register them
    fleet.stop()

A backend that starts servers gives one :class:`~posttrain.core.rollout.backend.EngineLaunch` per engine
(``resources.num_engines`` of them); one with fixed ``urls()`` (``external``) starts nothing. With
``rollout.use_router`` the real sglang-router fronts them all.

The fleet makes the run's engine API key (``api_key``; a fixed-URL backend may give its own): every
engine gets it in its ``EngineSlot``, the router by environment, and every client the fleet hands out
sends it. A dead engine is restarted on its port, or on a fresh one when that port is taken.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from posttrain.core.errors import RunFailed
from posttrain.core.rollout.backend import EngineSlot, gpu_ids
from posttrain.core.rollout.procs import ManagedServer, free_port, port_free, where_logged
from posttrain.core.rollout.router import RouterProcess


def visible_device(index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should see this process's GPU ``index`` alone (the
    parent's own ``CUDA_VISIBLE_DEVICES`` list, when set, maps the index)."""
    import os

    parent = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if parent:
        if index >= len(parent):
            raise ValueError(f"rollout.engine.device: cuda:{index} but CUDA_VISIBLE_DEVICES has {len(parent)} GPU(s)")
        return parent[index].strip()
    return str(index)


def run_sampling(rollout: Any, seed: int) -> dict[str, Any] | None:
    """``rollout``'s sampling_params as a run's requests send them (``EngineSlot.sampling``): SGLang's form, with a
    ``sampling_seed`` when the run seeds its samples (seeded rows take another sampling path in an engine)."""
    make = getattr(rollout, "sampling_params", None)
    if make is None:
        return None
    params = make(seed=seed)
    return {**params.to_sglang(), **({"sampling_seed": params.seed} if params.seed is not None else {})}


class EngineFleet:
    """Starts, watches and stops the engines of one run (and their router)."""

    def __init__(self, rollout: Any, resources: Any, backend: Any, model_path: str, log_dir: str | Path | None = None,
                 seed: int = 0, host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 weights_from_push: bool = False):
        """``weights_from_push``: the servers read ``model_path``'s config and tokenizer, no weights (the
        backend must have ``starts_without_weights``); the run pushes every weight before generating."""
        if weights_from_push and not backend.starts_without_weights:
            raise ValueError(f"rollout.engine: backend {backend.name!r} cannot start without weights")
        self.weights_from_push = weights_from_push
        self.rollout, self.resources, self.backend, self.model_path = rollout, resources, backend, str(model_path)
        self.log_dir = Path(log_dir) if log_dir else None
        self.seed, self.host, self.env = seed, host, env
        self.servers: list[ManagedServer] = []
        self.external: list[str] = []
        self.router: RouterProcess | None = None
        self._dropped: set[str] = set()  # dead engines already taken off the router
        self._model_pending = False  # launched before model_path was written (restarts on a fresh port too)
        self.api_key = backend.api_key() or secrets.token_urlsafe(32)

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / name

    def _server(self, i: int) -> ManagedServer:
        port = free_port(self.host)
        gpus = gpu_ids(self.resources, i) if self.backend.on_gpu(self.resources) else []
        launch = self.backend.launch(EngineSlot(index=i, port=port, host=self.host, model_path=self.model_path,
                                                seed=self.seed, resources=self.resources, gpus=gpus,
                                                api_key=self.api_key, model_pending=self._model_pending,
                                                weights_from_push=self.weights_from_push,
                                                sampling=run_sampling(self.rollout, self.seed),
                                                exact=bool(getattr(self.rollout, "exact", False))))
        return ManagedServer(launch.command, f"http://{self.host}:{port}", log_path=self._log(f"engine-{i}.log"),
                             env={**(self.env or {}), **launch.env}, health_path=launch.health_path)

    def start(self) -> EngineFleet:
        """Start every engine and the router; return once all answer."""
        return self.launch().wait_ready()

    def launch(self, model_pending: bool = False) -> EngineFleet:
        """Start the engines' processes without waiting for them (:meth:`wait_ready` does). ``model_pending``:
        ``model_path`` is still being written (a backend with ``waits_for_checkpoint`` only): the servers
        get ready meanwhile and load it once it appears."""
        if model_pending and not self.backend.waits_for_checkpoint:
            raise ValueError(f"rollout.engine: backend {self.backend.name!r} cannot start before its checkpoint")
        try:
            fixed = self.backend.urls()
            if fixed is not None:
                if not fixed:
                    raise ValueError(f"rollout.engine: backend {self.backend.name!r} gave no engine URLs")
                self.external = list(fixed)
            else:
                self._model_pending = model_pending
                self.servers = [self._server(i) for i in range(self.resources.num_engines)]
                for s in self.servers:  # start all, then wait: engines load their weights in parallel
                    s.start(wait=False)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> EngineFleet:
        """Wait for every engine :meth:`launch` started, then start the router in front of them (once)."""
        try:
            for i in range(len(self.servers)):
                self._wait_ready(i)
            if self.rollout.use_router and self.router is None:
                self.router = RouterProcess(self.engine_urls, host=self.host, model_path=self.model_path,
                                            extra_args=list(self.rollout.router_args), log_path=self._log("router.log"),
                                            api_key=self.api_key)
                self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, i: int, attempts: int = 3) -> None:
        """Wait for engine ``i``. Its port came from ``free_port`` seconds before the engine binds it, and
        another process (a parallel run, an xdist worker, a client's ephemeral port) may take it in between:
        the engine then exits "address already in use", whether or not the port is still held when we look.
        Such an engine starts again on a fresh port, up to
        ``attempts`` times; any other exit, or no answer in time, is a RunFailed naming its log."""
        for attempt in range(attempts):
            s = self.servers[i]
            try:
                return s.wait_ready()
            except RuntimeError as exc:  # the process exited before it answered
                if attempt + 1 == attempts or (port_free(s.base_url) and not _bind_failed(s)):
                    raise self._failed(i, s, exc) from exc
            except TimeoutError as exc:
                raise self._failed(i, s, exc) from exc
            self.servers[i] = self._server(i)
            self.servers[i].start(wait=False)

    def _failed(self, i: int, server: ManagedServer, exc: BaseException) -> RunFailed:
        """One line for engine ``i`` that could not start: what happened, its log, and the log's last line."""
        return RunFailed(f"engine {i}: {exc}{where_logged(server.log_path)}")

    @property
    def engine_urls(self) -> list[str]:
        return self.external or [s.base_url for s in self.servers]

    @property
    def url(self) -> str:
        """Where generators send ``/generate``: the router, or the only engine."""
        if self.router is not None:
            return self.router.url
        if len(self.engine_urls) != 1:
            raise ValueError("several engines and no router: set rollout.use_router: true")
        return self.engine_urls[0]

    def client(self):
        from posttrain.core.rollout.client import EngineClient

        return EngineClient(self.url, max_concurrency=self.rollout.server_concurrency, api_key=self.api_key)

    def weight_sender(self, backend: str = "gloo"):
        """A :class:`~posttrain.core.rollout.weight_sync.WeightSender` over every engine (not the router)."""
        from posttrain.core.rollout.weight_sync import WeightSender

        return WeightSender(self.engine_urls, backend=backend, api_key=self.api_key,
                            ranks_per_engine=self.backend.ranks_per_engine(self.resources),
                            flat=self.backend.flat_weight_buckets)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees its GPU memory (``tags``: ``weights``, ``kv_cache``; default both) for a
        colocated trainer; ``resume_memory`` takes it back."""
        self._all(lambda url: self.backend.release_memory(url, tags, api_key=self.api_key))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._all(lambda url: self.backend.resume_memory(url, tags, api_key=self.api_key))

    def server_states(self) -> list[dict[str, Any]]:
        """Each engine's ``/get_server_info`` ``internal_states[0]``: posttrain's engine reports ``memory``
        (GiB on CUDA) and ``totals`` (its work since start, ``core.metrics.ServerMetrics``). Engines not on
        GPUs are not asked (empty dicts): this runs every step."""
        from posttrain.core.rollout.weight_sync import post_json

        if not self.backend.on_gpu(self.resources):
            return [{} for _ in self.engine_urls]
        out = []
        for url in self.engine_urls:
            try:
                info = post_json(url + "/get_server_info", timeout=30, api_key=self.api_key, method="GET")
            except (OSError, ValueError, RuntimeError):  # a dead engine has no figures; the push restarts it
                info = {}
            out.append((info.get("internal_states") or [{}])[0])
        return out

    def _all(self, call: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(self.engine_urls))) as pool:
            list(pool.map(call, self.engine_urls))

    def drop_dead(self) -> list[str]:
        """Engines whose process died since the last check leave the router (cheap: no HTTP to engines),
        so resent requests reach the live ones; ``check_and_restart`` brings them back. Their URLs."""
        dead = [s for s in self.servers if s.proc is not None and not s.alive() and s.base_url not in self._dropped]
        for s in dead:
            self._dropped.add(s.base_url)
            if self.router is not None:
                self.router.remove_worker(s.base_url)
        return [s.base_url for s in dead]

    def check_and_restart(self) -> list[str]:
        """Restart engines that died or stopped answering (on a fresh port when theirs is taken); returns
        their URLs, new ones included (re-read ``engine_urls``, re-sync their weights)."""
        restarted = []
        for i, s in enumerate(self.servers):
            old = s.base_url
            try:
                if s.alive() or port_free(old):
                    if not s.ensure_running():
                        continue
                else:
                    raise RuntimeError(f"{old}: port taken while the engine was down")
            except (RuntimeError, TimeoutError):  # it cannot (or could not) start on its old port
                s.stop()
                s = self.servers[i] = self._server(i)
                try:
                    s.start(wait=True)
                except (RuntimeError, TimeoutError) as exc:
                    raise self._failed(i, s, exc) from exc
            self._dropped.discard(old)
            restarted.append(s.base_url)
            if self.router is not None:
                self.router.remove_worker(old)
                self.router.add_worker(s.base_url)
        return restarted

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for s in self.servers:
            s.stop()

    def __enter__(self) -> EngineFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bind_failed(server: ManagedServer) -> bool:
    """Whether ``server``'s log ends with its bind failing ("address already in use")."""
    path = server.log_path
    if path is None or not Path(path).exists():
        return False
    return "address already in use" in Path(path).read_text(errors="replace")[-4000:].lower()
