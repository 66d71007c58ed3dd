"""The engine role: the rollout engines and the router in front of them (an ``EngineFleet``)."""

from __future__ import annotations

from typing import Any


class EngineRole:
    """Starts the fleet from the resolved run config; the loop asks it for URLs and restarts."""

    def __init__(self, config: dict[str, Any], model_path: str, log_dir: str):
        from posttrain.core.config import RolloutConfig, ResourcesConfig
        from posttrain.core.rollout.fleet import EngineFleet
        from posttrain.core.schema import build

        rollout, _ = build(RolloutConfig, config["rollout"], "rollout")
        resources, _ = build(ResourcesConfig, config["resources"], "resources")
        self.fleet = EngineFleet(rollout, resources, model_path, log_dir=log_dir, seed=config.get("seed", 0)).start()

    def urls(self) -> tuple[str, list[str]]:
        """``(url generators talk to, every engine's own URL)``."""
        return self.fleet.url, self.fleet.engine_urls

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.fleet.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.fleet.resume_memory(tags)

    def memory_stats(self) -> list[dict[str, Any]]:
        return self.fleet.memory_stats()

    def drop_dead(self) -> list[str]:
        return self.fleet.drop_dead()

    def check_and_restart(self) -> list[str]:
        return self.fleet.check_and_restart()

    def close(self) -> None:
        self.fleet.stop()
