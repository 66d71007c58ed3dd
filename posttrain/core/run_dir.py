"""A run directory: the resolved config, plugin versions, metrics, logs and checkpoints of one run.

::

    runs/quickstart-20261129-201500/
      .lock                # held (flock) by the one process writing here; holds its PID
      config.yaml          # resolved run config (what --resume reads back), secrets <redacted>
      secrets.yaml         # the redacted values (mode 0600), for --resume
      plugins.json         # every loaded plugin with its distribution and version
      metrics.jsonl        # one JSON object per step, "step" counted from 1 (as the console counts)
      rollouts.jsonl       # per step: the prompts served (data order) and a few samples
      tensorboard/  logs/  # TensorBoard events; engine, router and trainer logs
      checkpoints/step_000010/   # after 10 steps: trainer state (Megatron dist-checkpointing) + state.json
      checkpoints/latest         # name of the newest complete checkpoint
      hf-init/             # what the engines start from: config.json and the tokenizer (core.hf_init), the initial
                           # weights too with checkpoint.hf_init_weights; appears whole (written as hf-init.partial)
      hf-final/            # HF checkpoint of the final policy (rl-cli models export: any checkpoint's)
      curves.png           # written at the end (rl-cli plot RUN_DIR redraws it)

A checkpoint is written into ``checkpoints/.tmp-step_N``, synced to the disk and renamed into place, and
``latest`` is replaced atomically (and synced) after that: a crash mid-write, of the program or of the OS,
never corrupts the last good checkpoint, and a write that fails (a full disk) removes its part. Its
``state.json`` keeps the config (redacted) and the model's tensor shapes, so a resume with another
model is refused and config changes since the checkpoint are named.

Steps are counted from 1 everywhere a user meets them: step ``N`` is the N-th step, its ``metrics.jsonl`` and
``rollouts.jsonl`` rows carry ``"step": N``, and the checkpoint written after it is ``step_N`` (its ``state.json``
holds ``"steps": N``, the steps it has trained).

One process writes a run directory: :meth:`RunDirectory.lock` takes an exclusive ``flock`` on ``.lock``
(released by the kernel when the process dies, however it dies); a second writer stops with exit code 2,
naming the holder's PID.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from posttrain.core import secrets
from posttrain.core.errors import RunFailed, UsageError
from posttrain.core.storage import fsync_dir, fsync_tree, storage_failure, write_durably

log = logging.getLogger("posttrain.run")


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = Path(".")  # relative data paths are also tried against this (the config's folder)
        self.checkpoints = self.path / "checkpoints"
        self.logs = self.path / "logs"

    @classmethod
    def create(cls, path: str | Path | None, config_name: str) -> RunDirectory:
        path = Path(path) if path else Path("runs") / f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path).lock()  # before the emptiness check: a concurrent writer is named, not raced
        if any(p.name != ".lock" for p in path.iterdir()):
            run.unlock()
            raise UsageError(f"--run-dir {path}: exists and is not empty (use --resume {path} to continue it)")
        run.logs.mkdir(parents=True, exist_ok=True)
        return run

    def fresh_dir(self, name: str) -> str:
        """``path/name`` with nothing there: one left by an earlier start of this run (``hf-init`` of a resumed
        run, which writes it again) is removed, so engines that wait for it to appear load the new one."""
        target = self.path / name
        shutil.rmtree(target, ignore_errors=True)
        return str(target)

    def lock(self) -> RunDirectory:
        """Hold ``.lock`` exclusively for this process's life; another holder is a UsageError naming its PID."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{self.path}: run directory in use by another process (PID {holder}); "
                             "one process writes a run directory at a time") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        return self

    def unlock(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def write_config(self, config: dict[str, Any], plugins: Any) -> None:
        """``config.yaml`` with secrets redacted; the secrets in ``secrets.yaml`` (owner-only) for ``--resume``."""
        clean, found = secrets.split(config)
        (self.path / "config.yaml").write_text(yaml.safe_dump(clean, sort_keys=False))
        if found:
            fd = os.open(self.path / "secrets.yaml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(yaml.safe_dump(found, sort_keys=False))
        infos = [{"name": i.name, "distribution": i.distribution, "version": i.version, "module": i.module}
                 for i in plugins.infos.values()]
        (self.path / "plugins.json").write_text(json.dumps(infos, indent=2))

    def read_config(self) -> dict[str, Any]:
        path = self.path / "config.yaml"
        if not path.is_file():
            raise UsageError(f"--resume {self.path}: no config.yaml there (not a run directory)")
        config = yaml.safe_load(path.read_text())
        kept = self.path / "secrets.yaml"
        return secrets.merge(config, yaml.safe_load(kept.read_text()) or {}) if kept.is_file() else config

    def log_rollouts(self, step: int, groups: list[list[Any]], examples: list[dict[str, Any]]) -> None:
        """The prompts of step ``step``'s groups (counted from 1), in order, and a few samples (``rollouts.jsonl``)."""
        row = {"step": step, "prompts": [g[0].prompt for g in groups if g], "examples": examples}
        with open(self.path / "rollouts.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def truncate_after(self, steps: int) -> None:
        """A resumed run re-does the steps after the first ``steps``: drop what they logged before."""
        from posttrain.core.metrics import truncate_jsonl

        if (self.path / "rollouts.jsonl").exists():
            truncate_jsonl(self.path / "rollouts.jsonl", steps)

    # ---------------------------------------------------------------- checkpoints
    def latest_checkpoint(self) -> Path | None:
        marker = self.checkpoints / "latest"
        if not marker.is_file():
            return None
        path = self.checkpoints / marker.read_text().strip()
        return path if (path / "state.json").is_file() else None

    def checkpoint_step(self, path: Path) -> int:
        """The steps a checkpoint holds: the number of the step it was written after (read without restoring
        anything)."""
        return steps_of(json.loads((path / "state.json").read_text()))

    def checkpoints_by_step(self) -> dict[int, Path]:
        """Every complete checkpoint by the number of steps it holds (``step_000010`` holds 10 steps)."""
        found = {}
        for path in sorted(self.checkpoints.glob("step_*")):
            if (path / "state.json").is_file():
                found[self.checkpoint_step(path)] = path
        return found

    def checkpoint_after(self, steps: int | None = None) -> Path:
        """The checkpoint written after ``steps`` steps (1-based, as ``rl-cli run`` counts them), or the latest.

        :raises UsageError: there is no such checkpoint (naming the ones there are).
        """
        if not self.path.is_dir():
            raise UsageError(f"{self.path}: no such run directory")
        found = self.checkpoints_by_step()
        have = ", ".join(f"{n} ({p.name})" for n, p in found.items()) or "none"
        if steps is None:
            latest = self.latest_checkpoint()
            if latest is None:
                raise UsageError(f"{self.path}: no checkpoint there (checkpoint.interval: 0, or it stopped before "
                                 f"the first); its final weights, if it finished, are in {self.path / 'hf-final'}")
            return latest
        if steps not in found:
            raise UsageError(f"--step {steps}: no checkpoint after {steps} steps in {self.path}; steps with one: {have}")
        return found[steps]

    def mark_complete(self, steps: int) -> None:
        """The run trained all ``steps`` steps (``complete.json``): ``--resume`` and ``--resume-or-start`` then
        leave it alone unless asked for more steps."""
        write_durably(self.path / "complete.json", json.dumps({"steps": int(steps)}))

    def completed_steps(self) -> int | None:
        """The steps of a run that finished (:meth:`mark_complete`), else None."""
        try:
            return int(json.loads((self.path / "complete.json").read_text())["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

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

    def save_checkpoint(self, steps: int, save_trainer: Any, state: dict[str, Any], keep: int) -> Path:
        """The checkpoint after ``steps`` steps (``step_{steps:06d}``): ``save_trainer(dir)`` writes the trainer's
        part; ``state`` (JSON-able) holds the rest."""
        name = f"step_{steps:06d}"
        tmp = self.checkpoints / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            save_trainer(str(tmp / "trainer"))
            if "config" in state:
                state = {**state, "config": secrets.redact(state["config"])}
            init = self.path / "hf-init"
            (tmp / "state.json").write_text(json.dumps({"steps": steps, **state, "model_shapes": hf_shapes(init),
                                                        "model_config": hf_config_of(init), "rng": _rng_state()}))
            fsync_tree(tmp)  # on the disk before anything names it: a crash leaves `latest` on a whole checkpoint
        except BaseException as exc:
            disk = storage_failure(exc, str(tmp))  # before the part is removed: a full disk is still full
            shutil.rmtree(tmp, ignore_errors=True)  # a part written to a full disk gives its space back
            if disk:
                raise RunFailed(disk) from exc
            raise
        final = self.checkpoints / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.checkpoints)
        write_durably(self.checkpoints / "latest", name)
        for old in sorted(self.checkpoints.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def check_resume(self, ckpt: Path, config: dict[str, Any], model_dir: str | Path) -> list[str]:
        """Before resuming from ``ckpt``: refuse it (UsageError) when the model it holds differs from
        ``config``'s (the ``model`` section, a key of ``model_dir``'s ``config.json``, or any tensor name or shape of
        the weights there); log every other config key changed since it was written. Returns those changes."""
        state = json.loads((ckpt / "state.json").read_text())
        changes = config_changes(state["config"], secrets.redact(config)) if "config" in state else []
        saved, now = state.get("model_shapes"), hf_shapes(model_dir)
        problems = [c for c in changes if c.startswith("model.")]
        saved_hf, now_hf = state.get("model_config"), hf_config_of(model_dir)
        if saved_hf and now_hf and saved_hf != now_hf:
            keys = sorted(k for k in set(saved_hf) | set(now_hf) if saved_hf.get(k) != now_hf.get(k))
            problems.append(f"config.json {keys[0]}: {saved_hf.get(keys[0], 'absent')} in the checkpoint, "
                            f"{now_hf.get(keys[0], 'absent')} in this model ({len(keys)} differ)")
        if saved and now and saved != now:
            diff = sorted(set(saved) ^ set(now)) or sorted(k for k in now if saved[k] != now[k])
            first = diff[0]
            problems.append(f"tensor {first}: {saved.get(first, 'absent')} in the checkpoint, "
                            f"{now.get(first, 'absent')} in this model ({len(diff)} differ)")
        if problems:
            raise UsageError(f"--resume {self.path}: {ckpt.name} holds another model than the config: "
                             + "; ".join(problems[:4]))
        for change in changes:
            log.warning("resume: config changed since %s: %s", ckpt.name, change)
        return changes

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """A checkpoint's ``state.json`` (``"steps"``: the steps it holds), restoring the RNGs it saved."""
        state = json.loads((path / "state.json").read_text())
        _set_rng_state(state.pop("rng"))
        return {**state, "steps": steps_of(state)}


def steps_of(state: dict[str, Any]) -> int:
    """The steps a checkpoint's ``state.json`` holds: ``"steps"``, or ``"step"`` + 1 in checkpoints written when
    the 0-based index of the last step was stored."""
    return int(state["steps"]) if "steps" in state else int(state["step"]) + 1


def hf_config_of(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint directory (the model's shape, whether or not weights are there);
    empty where there is none."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def hf_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of an HF checkpoint, read from the safetensors headers (no tensor data)."""
    out: dict[str, list[int]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


def config_changes(old: Any, new: Any, path: str = "") -> list[str]:
    """``"key.sub: old -> new"`` for every leaf that differs between two config trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in list(old) + [k for k in new if k not in old]
                for c in config_changes(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in config_changes(a, b, f"{path}.{i}")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def _rng_state() -> dict[str, Any]:
    import torch

    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import ast

    import torch

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
