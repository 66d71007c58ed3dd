"""Run modes: the interface a ``posttrain_register_modes`` plugin implements.

A run mode is what ``rl-cli run`` does with a validated config: the RL loop (generate, reward, train,
push weights) or supervised fine-tuning on labelled data (no engines), and whatever a plugin adds
(offline preference training, ...). The config selects it by ``mode:`` and passes the section's other
keys to its ``Config``; every mode shares the rest of the config (``model``, ``data``, ``loss``,
``trainer``, ``checkpoint``, ``logging``, ``eval``) and writes the same run directory::

    mode: {name: sft, max_steps: 200}

The class declares what validation needs to know before anything starts:

- ``generates``: it generates with the rollout engines, so ``rollout_batch_size x n_samples_per_prompt =
  global_batch_size x steps_per_rollout`` must hold;
- ``required``: sections reported as ``required key is missing`` by config validation;
- ``needed_to_train``: sections a run needs but ``--dry-run`` only notes;
- ``smoke_overrides``: what ``rl-cli run --smoke`` adds to run two steps;
- ``columns``: ``(label, metric key, format)`` of the live progress display (empty: the RL loop's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.core.interfaces import Component


class RunMode(Component):
    """Base of every run mode. Subclasses set ``name`` and implement :meth:`run` (and ``total_steps``)."""

    name = ""
    is_default = False
    generates = True
    required: tuple[str, ...] = ()
    needed_to_train: tuple[str, ...] = ()
    smoke_overrides: tuple[str, ...] = ()
    columns: tuple[tuple[str, str, str], ...] = ()

    @dataclass
    class Config:
        pass

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        """Problems with this mode for ``run`` (a validated RunConfig), as ``key: reason`` lines reported
        with every other config error before anything starts. Default: none."""
        return []

    def inspect_data(self, run: Any) -> tuple[str | None, list[str]]:
        """``(summary, problems)`` of the mode's data for ``rl-cli run --dry-run``. Default: the prompt data
        of ``data:``, as the RL loop reads it (``posttrain.core.data``)."""
        from posttrain.core.data import check_data, load_prompts

        problems = check_data(run.data)
        return (None if problems else load_prompts(run.data).summary()), problems

    def total_steps(self, run: Any) -> int:
        """Steps the run will take (progress display and ETA only)."""
        raise NotImplementedError

    async def run(self, cfg: Any, plugins: Any, run: Any, resume: bool = False, on_step: Any = None,
                  on_phase: Any = None) -> dict[str, float]:
        """Run ``cfg`` in ``run`` (a RunDirectory); ``on_step(index, metrics, samples)`` after each logged
        step, with the step's 0-based index (the display shows step ``index + 1``, the number metrics.jsonl and
        checkpoints carry), ``on_phase(name)`` at each start-up phase; with ``resume``, continue from the run's latest
        checkpoint. Returns the last metrics."""
        raise NotImplementedError
