"""The ``rl`` run mode: the RL loop of :mod:`posttrain.core.loop` (the default mode)."""

from __future__ import annotations

from typing import Any

from posttrain import hookimpl
from posttrain.core.run_mode import RunMode


class RLMode(RunMode):
    """Reinforcement learning: prompts -> engines generate -> rewards -> estimator -> loss -> weights back.

    The loop of ``posttrain.core.loop`` for ``rollout.num_rollouts`` steps, with engines of
    ``rollout.engine`` and the trainer of ``trainer.backend``; what a config without ``mode:`` runs.
    Needs ``estimator`` (validated), ``model``, ``generator`` and ``loss`` (to train).
    """

    name = "rl"
    is_default = True
    generates = True
    required = ("estimator",)
    needed_to_train = ("model", "generator", "loss")
    smoke_overrides = ("rollout.num_rollouts=2",)

    def total_steps(self, run: Any) -> int:
        return run.rollout.num_rollouts

    async def run(self, cfg: Any, plugins: Any, run: Any, resume: bool = False, on_step: Any = None,
                  on_phase: Any = None) -> dict[str, float]:
        from posttrain.core.loop import train

        return await train(cfg, plugins, run, resume=resume, on_step=on_step, on_phase=on_phase)


@hookimpl
def posttrain_register_modes(registry):
    registry.add(RLMode)
