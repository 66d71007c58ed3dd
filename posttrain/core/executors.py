"""Where the roles run. ``local``: the trainer in this process and engine servers as child processes
(fastest start, easiest to debug). ``ray``: the same role classes as Ray actors, each rebuilding its plugin
manager from the installed entry points. The loop talks to both through the same methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.core.actors.engines import EngineRole
from posttrain.core.actors.teacher import TeacherRole
from posttrain.core.actors.trainer import TrainerRole


class LocalExecutor:
    """Roles as plain objects in this process (the engines' servers are still their own processes)."""

    def __init__(self, cfg: Any, **load_args: list[str]):
        self.cfg, self.load_args = cfg, load_args  # load_plugins() arguments: every role rebuilds the same set

    def trainer(self) -> TrainerRole:
        return TrainerRole(self.cfg.to_dict(), self.load_args)

    def engines(self, model_path: str, log_dir: Path) -> EngineRole:
        return EngineRole(self.cfg.to_dict(), model_path, str(log_dir), self.load_args)

    def teacher(self, log_dir: Path) -> TeacherRole:
        return TeacherRole(self.cfg.to_dict(), str(log_dir), self.load_args)

    def close(self) -> None:
        pass


class RayExecutor:
    """Roles as Ray actors: the trainer gets ``trainer_gpus_per_node`` GPUs (or a CPU), the engine role
    ``rollout_gpus``. Starts a local Ray instance unless ``resources.ray_address`` names a cluster."""

    def __init__(self, cfg: Any, **load_args: list[str]):
        import ray

        self.cfg, self.load_args = cfg, load_args
        r = cfg.resources
        if not ray.is_initialized():
            ray.init(address=r.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, **({} if r.ray_address else {"num_cpus": max(2, _cpus())}))
        self._actors: list[Any] = []

    def _actor(self, cls: type, *args: Any, num_gpus: float = 0) -> _RemoteHandle:
        import ray

        actor = ray.remote(cls).options(num_cpus=1, num_gpus=num_gpus, max_concurrency=2).remote(*args)
        self._actors.append(actor)
        return _RemoteHandle(actor)

    def trainer(self) -> _RemoteHandle:
        r = self.cfg.resources
        return self._actor(TrainerRole, self.cfg.to_dict(), self.load_args, num_gpus=r.trainer_gpus_per_node)

    def engines(self, model_path: str, log_dir: Path) -> _RemoteHandle:
        return self._actor(EngineRole, self.cfg.to_dict(), model_path, str(log_dir), self.load_args,
                           num_gpus=self.cfg.resources.rollout_gpus)

    def teacher(self, log_dir: Path) -> _RemoteHandle:
        """The teacher's fleet in an actor of its own (GPU engines name their device: ``cuda:N``)."""
        return self._actor(TeacherRole, self.cfg.to_dict(), str(log_dir), self.load_args)

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()
        ray.shutdown()


class _RemoteHandle:
    """Calls an actor's methods synchronously (``ray.get``), so the loop reads the same under both."""

    def __init__(self, actor: Any):
        self._actor = actor

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def _cpus() -> int:
    import os

    return os.cpu_count() or 2


EXECUTORS = {"local": LocalExecutor, "ray": RayExecutor}
