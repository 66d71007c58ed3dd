"""The engine role: the rollout engines of the selected engine backend and the router in front of them
(an ``EngineFleet``)."""

from __future__ import annotations

from typing import Any


class EngineRole:
    """Starts the fleet from the resolved run config; the loop asks it for URLs and restarts.

    ``model_pending``: ``model_path`` is still being written (the engine backend must have
    ``waits_for_checkpoint``). ``weights_from_push``: the engines read ``model_path``'s config and tokenizer,
    no weights (the backend must have ``starts_without_weights``), and take them from the first push.
    ``wait``: the engines answer when this returns; False: they are launched and :meth:`wait_ready` waits
    for them (default: False when ``model_pending``). ``visible_devices``: this process's
    ``CUDA_VISIBLE_DEVICES`` (an engine's ``cuda:i`` is its ``i``-th), where the executor knows the GPUs better
    than the environment does (a Ray actor sharing a trainer group's bundle)."""

    def __init__(self, config: dict[str, Any], model_path: str, log_dir: str,
                 load_args: dict[str, list[str]] | None = None, model_pending: bool = False,
                 weights_from_push: bool = False, wait: bool | None = None, visible_devices: str | None = None):
        import os

        from posttrain.core.config import load_config
        from posttrain.core.plugins import load_plugins
        from posttrain.core.rollout.fleet import EngineFleet

        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        plugins = load_plugins(**(load_args or {}))
        cfg = load_config(None, data=config, plugins=plugins)
        self.fleet = EngineFleet(cfg.rollout, cfg.resources, cfg.rollout.engine.create(plugins), model_path,
                                 log_dir=log_dir, seed=cfg.seed, weights_from_push=weights_from_push)
        self.fleet.launch(model_pending)
        if (not model_pending) if wait is None else wait:
            self.fleet.wait_ready()

    def wait_ready(self) -> None:
        """Return once every engine answers (and the router, if any, is up)."""
        self.fleet.wait_ready()

    def urls(self) -> tuple[str, list[str]]:
        """``(url generators talk to, every engine's own URL)``."""
        return self.fleet.url, self.fleet.engine_urls

    def api_key(self) -> str:
        """The run's engine API key (clients, the weight sender and the router send it)."""
        return self.fleet.api_key

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.fleet.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.fleet.resume_memory(tags)

    def server_states(self) -> list[dict[str, Any]]:
        return self.fleet.server_states()

    def processes(self) -> list[tuple[str, int, str | None]]:
        """``(label, pid, log)`` of each engine server running here (the watchdog's report asks them for their
        state and stacks)."""
        return [(f"engine {s.base_url}", s.proc.pid, str(s.log_path) if s.log_path else None)
                for s in self.fleet.servers if getattr(s, "proc", None) is not None]

    def drop_dead(self) -> list[str]:
        return self.fleet.drop_dead()

    def check_and_restart(self) -> list[str]:
        return self.fleet.check_and_restart()

    def close(self) -> None:
        self.fleet.stop()
