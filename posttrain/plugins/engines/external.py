"""The ``external`` engine backend: SGLang-protocol servers that are already running (started by you, a
cluster scheduler or another tool). posttrain starts nothing, fronts them with the router and pushes
weights to them; a dead one leaves the router but cannot be restarted from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend
from posttrain.core.schema import option


class ExternalEngines(EngineBackend):
    """Running servers at ``urls`` (SGLang, or posttrain's ``rl-cli engine serve``)."""

    name = "external"
    starts_without_weights = True  # running already: nothing of the run's hf-init is read, the first push updates them

    @dataclass
    class Config:
        urls: list[str] = option(default_factory=list, help="base URLs of the running engines")
        device: Literal["cpu", "cuda"] = option(
            "cuda", help="where those engines hold their weights: picks NCCL (cuda) or Gloo (cpu) for "
                         "weight_sync: distributed")
        tp: int = option(1, ge=1, help="ranks each engine adds to a distributed weight-update group (its TP size)")
        api_key_env: str = option("POSTTRAIN_ENGINE_API_KEY", help="environment variable holding the engines' API "
                                  "key (sent as Authorization: Bearer KEY); the key itself never goes in the config")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        bad = [u for u in self.config.urls if not u.startswith(("http://", "https://"))]
        errors = [f"rollout.engine.urls: {u!r} is not an http(s) URL" for u in bad]
        if not self.config.urls:
            errors.append("rollout.engine.urls: the external backend needs at least one URL")
        if run.resources.colocate:
            errors.append("resources.colocate: external engines are not started by this run, so they cannot "
                          "share its GPUs; set it false")
        return errors

    def on_gpu(self, resources: Any) -> bool:
        return self.config.device == "cuda"

    def engine_gpus(self, resources: Any) -> list[int]:
        return []  # not this run's processes: their GPUs are not placed by it

    def ranks_per_engine(self, resources: Any) -> int:
        return self.config.tp

    def urls(self) -> list[str]:
        return [u.rstrip("/") for u in self.config.urls]

    def api_key(self) -> str | None:
        import os

        return os.environ.get(self.config.api_key_env) or None


@hookimpl
def posttrain_register_engines(registry):
    registry.add(ExternalEngines)
