"""A run directory: the resolved config, plugin versions, metrics, logs and checkpoints of one run.

::

    runs/quickstart-20261129-201500/
      config.yaml          # resolved run config (what --resume reads back)
      plugins.json         # every loaded plugin with its distribution and version
      metrics.jsonl        # one JSON object per step
      rollouts.jsonl       # per step: the prompts served (data order) and a few samples
      tensorboard/  logs/  # TensorBoard events; engine, router and trainer logs
      checkpoints/step_000010/   # trainer state (Megatron dist-checkpointing) + state.json
      checkpoints/latest         # name of the newest complete checkpoint
      curves.png           # written at the end (rl-cli plot RUN_DIR redraws it)

A checkpoint is written into ``checkpoints/.tmp-step_N`` and renamed into place, and ``latest`` is
replaced atomically after that: a crash mid-write never corrupts the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from posttrain.core.errors import UsageError


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = Path(".")  # relative data paths are also tried against this (the config's folder)
        self.checkpoints = self.path / "checkpoints"
        self.logs = self.path / "logs"

    @classmethod
    def create(cls, path: str | Path | None, config_name: str) -> RunDirectory:
        path = Path(path) if path else Path("runs") / f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if path.exists() and any(path.iterdir()):
            raise UsageError(f"--run-dir {path}: exists and is not empty (use --resume {path} to continue it)")
        run = cls(path)
        run.logs.mkdir(parents=True, exist_ok=True)
        return run

    def write_config(self, config: dict[str, Any], plugins: Any) -> None:
        (self.path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        infos = [{"name": i.name, "distribution": i.distribution, "version": i.version, "module": i.module}
                 for i in plugins.infos.values()]
        (self.path / "plugins.json").write_text(json.dumps(infos, indent=2))

    def read_config(self) -> dict[str, Any]:
        path = self.path / "config.yaml"
        if not path.is_file():
            raise UsageError(f"--resume {self.path}: no config.yaml there (not a run directory)")
        return yaml.safe_load(path.read_text())

    def log_rollouts(self, step: int, groups: list[list[Any]], examples: list[dict[str, Any]]) -> None:
        """The prompts of a step's groups, in order, and a few samples (``rollouts.jsonl``)."""
        row = {"step": step, "prompts": [g[0].prompt for g in groups if g], "examples": examples}
        with open(self.path / "rollouts.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def truncate_after(self, step: int) -> None:
        """A resumed run re-does the steps after its checkpoint: drop what they logged before."""
        from posttrain.core.metrics import truncate_jsonl

        if (self.path / "rollouts.jsonl").exists():
            truncate_jsonl(self.path / "rollouts.jsonl", step)

    # ---------------------------------------------------------------- checkpoints
    def latest_checkpoint(self) -> Path | None:
        marker = self.checkpoints / "latest"
        if not marker.is_file():
            return None
        path = self.checkpoints / marker.read_text().strip()
        return path if (path / "state.json").is_file() else None

    def checkpoint_step(self, path: Path) -> int:
        """The 0-based step a checkpoint was written after (read without restoring anything)."""
        return int(json.loads((path / "state.json").read_text())["step"])

    def resume_point(self) -> tuple[Path, int]:
        """``(checkpoint, step)`` that ``--resume`` continues from.

        :raises UsageError: not a run directory, or no complete checkpoint in it (with the reason).
        """
        config = self.read_config()
        ckpt = self.latest_checkpoint()
        if ckpt is not None:
            return ckpt, self.checkpoint_step(ckpt)
        interval = (config.get("checkpoint") or {}).get("interval", 0) if isinstance(config, dict) else 0
        why = ("its config has checkpoint.interval: 0 (no checkpoints)" if not interval else
               f"it stopped before its first checkpoint (checkpoint.interval: {interval})")
        raise UsageError(f"--resume {self.path}: nothing to resume, no checkpoint there: {why}. Start it "
                         f"over in place with `rl-cli run --resume-or-start {self.path}`, or start a new run")

    def save_checkpoint(self, step: int, save_trainer: Any, state: dict[str, Any], keep: int) -> Path:
        """``save_trainer(dir)`` writes the trainer's part; ``state`` (JSON-able) holds the rest."""
        name = f"step_{step:06d}"
        tmp = self.checkpoints / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_trainer(str(tmp / "trainer"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, "rng": _rng_state()}))
        final = self.checkpoints / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker_tmp = self.checkpoints / ".latest.tmp"
        marker_tmp.write_text(name)
        os.replace(marker_tmp, self.checkpoints / "latest")
        for old in sorted(self.checkpoints.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = json.loads((path / "state.json").read_text())
        _set_rng_state(state.pop("rng"))
        return state


def _rng_state() -> dict[str, Any]:
    import torch

    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import ast

    import torch

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
