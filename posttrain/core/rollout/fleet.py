"""The engines of a run and the router in front of them, from the run config's ``rollout`` and ``resources``.

::

    fleet = EngineFleet(cfg.rollout, cfg.resources, model_path="/ckpt/hf", log_dir=run_dir / "logs").start()
    async with fleet.client() as engine:            # EngineClient on the router (or the single engine)
        samples = await generator(group, engine, cfg.rollout.sampling_params())
    sender = fleet.weight_sender(backend="gloo")     # trainer side of weight updates (see weight_sync)
    fleet.check_and_restart()                        # restart dead engines, re-register them
    fleet.stop()

``rollout.engine`` selects what runs: ``local`` starts ``resources.num_engines`` local engine servers
(``rl-cli engine serve``; on ``engine_device: cuda`` engine ``i`` uses ``cuda:(first + i x gpus_per_engine)``,
``first`` being 0 when colocated and the trainer's GPU count otherwise; ``cuda:N`` puts every engine on
GPU ``N``), ``sglang`` starts
``python -m sglang.launch_server`` per engine (``gpus_per_engine`` GPUs each, from ``base_gpu_id = i x
gpus_per_engine``), ``external`` uses ``rollout.engine_urls`` as they are. With ``rollout.use_router``
the real sglang-router fronts them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.core.rollout.launcher import (ManagedServer, local_engine_command, sglang_command,
                                             sglang_spec_from_config)
from posttrain.core.rollout.procs import free_port
from posttrain.core.rollout.router import RouterProcess


def visible_device(index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should see this process's GPU ``index`` alone (the
    parent's own ``CUDA_VISIBLE_DEVICES`` list, when set, maps the index)."""
    import os

    parent = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if parent:
        if index >= len(parent):
            raise ValueError(f"rollout.engine_device: cuda:{index} but CUDA_VISIBLE_DEVICES has {len(parent)} GPU(s)")
        return parent[index].strip()
    return str(index)


class EngineFleet:
    """Starts, watches and stops the engines of one run (and their router)."""

    def __init__(self, rollout: Any, resources: Any, model_path: str, log_dir: str | Path | None = None,
                 seed: int = 0, sglang_cli_options: dict[str, Any] | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None):
        self.rollout, self.resources, self.model_path = rollout, resources, str(model_path)
        self.log_dir = Path(log_dir) if log_dir else None
        self.seed, self.sglang_cli_options, self.host, self.env = seed, sglang_cli_options, host, env
        self.servers: list[ManagedServer] = []
        self.external: list[str] = []
        self.router: RouterProcess | None = None
        self._dropped: set[str] = set()  # dead engines already taken off the router

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / name

    def _server(self, i: int) -> ManagedServer:
        port = free_port(self.host)
        env = self.env
        if self.rollout.engine == "sglang":
            spec = sglang_spec_from_config(self.rollout, self.resources, self.model_path, port, engine_index=i,
                                           seed=self.seed, cli_options=self.sglang_cli_options)
            spec.host = self.host
            spec.base_gpu_id = i * self.resources.gpus_per_engine
            cmd = sglang_command(spec)
        else:
            device = self.rollout.engine_device
            if device == "cuda":  # disaggregated: the trainer's GPUs come first
                first = 0 if self.resources.colocate else self.resources.trainer_gpus_per_node
                device = f"cuda:{first + i * self.resources.gpus_per_engine}"
            env = dict(self.env or {})
            if device.startswith("cuda:"):  # the engine sees its GPU alone, as cuda:0, in every thread
                env["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":")[1]))
                device = "cuda"
            cmd = local_engine_command(self.model_path, port, host=self.host, device=device,
                                       max_running_requests=self.rollout.engine_max_running_requests,
                                       context_length=self.rollout.engine_context_length or None,
                                       cuda_graphs=device.startswith("cuda"),
                                       decode_attention=self.rollout.engine_decode_attention,
                                       compile=self.rollout.engine_compile)
        return ManagedServer(cmd, f"http://{self.host}:{port}", log_path=self._log(f"engine-{i}.log"), env=env)

    def start(self) -> EngineFleet:
        try:
            if self.rollout.engine == "external":
                if not self.rollout.engine_urls:
                    raise ValueError("rollout.engine_urls: engine 'external' needs at least one URL")
                self.external = [u.rstrip("/") for u in self.rollout.engine_urls]
            else:
                self.servers = [self._server(i) for i in range(self.resources.num_engines)]
                for s in self.servers:  # start all, then wait: engines load their weights in parallel
                    s.start(wait=False)
                for s in self.servers:
                    s.wait_ready()
            if self.rollout.use_router:
                self.router = RouterProcess(self.engine_urls, host=self.host, model_path=self.model_path,
                                            extra_args=list(self.rollout.router_args), log_path=self._log("router.log"))
                self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

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

        return EngineClient(self.url, max_concurrency=self.rollout.server_concurrency)

    def weight_sender(self, backend: str = "gloo"):
        """A :class:`~posttrain.core.rollout.weight_sync.WeightSender` over every engine (not the router)."""
        from posttrain.core.rollout.weight_sync import WeightSender

        per_engine = self.resources.gpus_per_engine if self.rollout.engine == "sglang" else 1
        return WeightSender(self.engine_urls, backend=backend, ranks_per_engine=per_engine)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees its GPU memory (``tags``: ``weights``, ``kv_cache``; default both) for a
        colocated trainer; ``resume_memory`` takes it back."""
        self._post_all("/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._post_all("/resume_memory_occupation", {"tags": tags} if tags else {})

    def memory_stats(self) -> list[dict[str, Any]]:
        """Each engine's ``/get_server_info`` memory figures (local engines report GiB on CUDA; engines
        elsewhere have none, so they are not asked: this runs every step)."""
        import json
        import urllib.request

        if not self.rollout.engine_device.startswith("cuda"):
            return [{} for _ in self.engine_urls]
        out = []
        for url in self.engine_urls:
            try:
                with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
                    info = json.loads(resp.read())
            except (OSError, ValueError):  # a dead engine has no figures; the weight push restarts it
                info = {}
            out.append((info.get("internal_states") or [{}])[0].get("memory", {}))
        return out

    def _post_all(self, path: str, payload: dict[str, Any]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from posttrain.core.rollout.weight_sync import post_json

        with ThreadPoolExecutor(max(1, len(self.engine_urls))) as pool:
            list(pool.map(lambda url: post_json(url + path, payload), self.engine_urls))

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
        """Restart engines that died or stopped answering; returns their URLs (re-sync their weights)."""
        restarted = []
        for s in self.servers:
            if s.ensure_running():
                self._dropped.discard(s.base_url)
                restarted.append(s.base_url)
                if self.router is not None:
                    self.router.remove_worker(s.base_url)
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
