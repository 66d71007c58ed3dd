"""The teacher role: the engines of ``teacher.engine`` serving ``teacher.path`` and their own router (an
``EngineFleet`` like the student's), for estimators that score samples with a teacher (on-policy
distillation). Its logs go to ``RUN_DIR/logs/teacher/``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


class TeacherRole:
    """Launches the teacher's fleet from the resolved run config (its checkpoint is its own, so it starts with the
    run, beside the trainer's build); :meth:`wait_ready` waits for it; the loop asks it for the URL to query."""

    def __init__(self, config: dict[str, Any], log_dir: str, load_args: dict[str, list[str]] | None = None):
        from posttrain.core.config import load_config
        from posttrain.core.plugins import load_plugins
        from posttrain.core.rollout.fleet import EngineFleet
        from posttrain.core.rollout.teacher import teacher_resources

        plugins = load_plugins(**(load_args or {}))
        cfg = load_config(None, data=config, plugins=plugins)
        t = cfg.teacher
        rollout = dataclasses.replace(cfg.rollout, use_router=t.use_router, router_args=[],
                                      server_concurrency=t.server_concurrency)
        self.fleet = EngineFleet(rollout, teacher_resources(cfg), t.engine.create(plugins), t.path or "",
                                 log_dir=Path(log_dir) / "teacher", seed=cfg.seed).launch()

    def wait_ready(self) -> None:
        """Return once the teacher's engines (and router) answer."""
        self.fleet.wait_ready()

    def url(self) -> str:
        """Where the teacher's ``/generate`` goes: its router, or its only engine."""
        return self.fleet.url

    def api_key(self) -> str:
        """The teacher fleet's own API key (its engines and router require it)."""
        return self.fleet.api_key

    def check_and_restart(self) -> list[str]:
        return self.fleet.check_and_restart()

    def close(self) -> None:
        self.fleet.stop()
