"""Where the roles run. ``local``: the trainer in this process (or, as a group of ranks, in child
processes) and engine servers as child processes (fastest start, easiest to debug). ``ray``: the same role
classes as Ray actors, each rebuilding its plugin manager from the installed entry points; a trainer group
is one actor per rank on a placement group (a bundle per node, several nodes through
``resources.ray_address``). The loop talks to all of them through the same methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.core.actors.engines import EngineRole
from posttrain.core.actors.teacher import TeacherRole
from posttrain.core.errors import UsageError
from posttrain.core.actors.trainer import TrainerRole
from posttrain.core.actors.trainer_group import LocalRanks, RayRanks, TrainerGroup


class LocalExecutor:
    """Roles as plain objects in this process (the engines' servers are still their own processes); a
    trainer of several ranks as child processes (:class:`~posttrain.core.actors.trainer_group.LocalRanks`).
    Engines may start before the trainer (``model_pending``: they load their checkpoint once it is written)."""

    engines_before_trainer = True

    def __init__(self, cfg: Any, **load_args: list[str]):
        self.cfg, self.load_args = cfg, load_args  # load_plugins() arguments: every role rebuilds the same set

    def trainer(self, log_dir: str | Path = "logs") -> TrainerRole | TrainerGroup:
        r = self.cfg.resources
        if r.trainer_world_size == 1:  # in this process: no start-up or pickling cost
            return TrainerRole(self.cfg.to_dict(), self.load_args)
        self._ranks = LocalRanks(r.trainer_world_size, r.procs_per_node, self.cfg.to_dict(), self.load_args,
                                 log_dir)
        return TrainerGroup(self._ranks)

    def engines(self, model_path: str, log_dir: Path, model_pending: bool = False, weights_from_push: bool = False,
                wait: bool | None = None) -> EngineRole:
        return EngineRole(self.cfg.to_dict(), model_path, str(log_dir), self.load_args, model_pending,
                          weights_from_push, wait)

    def teacher(self, log_dir: Path) -> TeacherRole:
        return TeacherRole(self.cfg.to_dict(), str(log_dir), self.load_args)

    def close(self) -> None:
        if getattr(self, "_ranks", None) is not None:  # also when the run failed before the loop could close it
            self._ranks.close()


class RayExecutor:
    """Roles as Ray actors: the trainer gets ``trainer_gpus_per_node`` GPUs (or a CPU), the engine role
    ``rollout_gpus``. Starts a local Ray instance unless ``resources.ray_address`` names a cluster. Engines may
    start before the trainer builds (``model_pending``), as under :class:`LocalExecutor`; a trainer group's
    placement group is still reserved before the engines' (:meth:`_trainer_placement`). A one-rank trainer has
    none: its actor asks for its GPU after the engines' (each actor sees only its own GPUs)."""

    engines_before_trainer = True

    def __init__(self, cfg: Any, **load_args: list[str]):
        import ray

        self.cfg, self.load_args = cfg, load_args
        r = cfg.resources
        if not ray.is_initialized():  # a local instance needs a CPU per rank and one for the engine role
            ray.init(address=r.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     **({} if r.ray_address else {"num_cpus": max(2, _cpus(), r.trainer_world_size + 1)}))
        self._actors: list[Any] = []
        self._groups: list[Any] = []  # placement groups
        self._trainer_group = None
        self._bundle_devices: str | None = None  # CUDA_VISIBLE_DEVICES of its bundle 0, for colocated engines

    def _actor(self, cls: type, *args: Any, num_gpus: float = 0, strategy: Any = None) -> _RemoteHandle:
        import ray

        options = {"scheduling_strategy": strategy} if strategy is not None else {}
        actor = ray.remote(cls).options(num_cpus=1, num_gpus=num_gpus, max_concurrency=2, **options).remote(*args)
        self._actors.append(actor)
        return _RemoteHandle(actor)

    def _placement(self, bundles: list[dict[str, float]], strategy: str, what: str, timeout_s: float = 120.0) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        group = placement_group(bundles, strategy=strategy)
        self._groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise UsageError(f"resources: the Ray cluster has no room for the {what} ({strategy} over {bundles}) "
                             f"after {timeout_s:.0f} s; it has {ray.available_resources()}")
        return group

    def trainer(self, log_dir: str | Path = "logs") -> _RemoteHandle | TrainerGroup:
        r = self.cfg.resources
        if r.trainer_world_size == 1:  # colocated: in the bundle its engine role shares (one node, whatever the cluster)
            return self._actor(TrainerRole, self.cfg.to_dict(), self.load_args,
                               num_gpus=self._colocated_share() or r.trainer_gpus_per_node,
                               strategy=self._in_group(self._trainer_placement()) if r.colocate else None)
        gpus = 1 if r.trainer_gpus_per_node else 0
        ranks = RayRanks(r.trainer_world_size, r.procs_per_node, self.cfg.to_dict(), self.load_args, log_dir,
                         self._trainer_placement(), gpus_per_rank=gpus)
        self._actors += ranks.actors
        return TrainerGroup(ranks)

    def _trainer_placement(self) -> Any:
        """The trainer group's placement group (a bundle of ``procs_per_node`` CPUs, and GPUs, per node), made on
        first use: by :meth:`trainer`, or before it by :meth:`engines` when they start first."""
        if self._trainer_group is None:
            r = self.cfg.resources
            bundles = [{"CPU": float(r.procs_per_node), **({"GPU": float(r.procs_per_node)} if r.trainer_gpus_per_node
                                                           else {})} for _ in range(r.trainer_nodes)]
            if r.colocate:  # the engine role's actor shares node 0's bundle
                bundles[0]["CPU"] += 1
            self._trainer_group = self._placement(bundles, "STRICT_SPREAD" if r.trainer_nodes > 1 else "PACK",
                                                  "trainer's placement group")
            if r.colocate and not self._colocated_share() and r.trainer_gpus_per_node:  # before a rank holds one
                self._bundle_devices = self._bundle_gpus(self._trainer_group, r.procs_per_node)
        return self._trainer_group

    def _colocated_share(self) -> float:
        """Of a colocated one-rank trainer's GPU, the part its actor and the engine role's each ask Ray for: half,
        so that Ray hands both the same GPU (``CUDA_VISIBLE_DEVICES``) and the engines sit on the trainer's, on a
        node whose other GPUs other jobs hold too. 0 elsewhere (a colocated trainer group's engine role asks for
        none and is given the GPUs of the group's bundle, :meth:`_bundle_gpus`)."""
        r = self.cfg.resources
        return 0.5 if r.colocate and r.trainer_world_size == 1 and r.trainer_gpus_per_node else 0.0

    @staticmethod
    def _in_group(group: Any) -> Any:
        """Ray's scheduling strategy for an actor in ``group``'s first bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    def engines(self, model_path: str, log_dir: Path, model_pending: bool = False, weights_from_push: bool = False,
                wait: bool | None = None) -> _RemoteHandle:
        """The engine role's actor. Colocated, it shares node 0's bundle of the trainer's placement group (also for
        one rank: on a cluster of several nodes, an actor without one could land away from the trainer's GPUs);
        beside a trainer group, a bundle of its own made after the group's; beside one rank, no placement group.
        Colocated with a trainer group, it asks Ray for no GPU and sees the bundle's (:meth:`_bundle_gpus`)."""
        r = self.cfg.resources
        strategy, devices = None, None
        if r.trainer_world_size > 1 or r.colocate:  # the trainer's group first, then the engines' bundle (or node 0's)
            trainer_group = self._trainer_placement()
            group = trainer_group if r.colocate else self._placement(
                [{"CPU": 1.0, **({"GPU": float(r.rollout_gpus)} if r.rollout_gpus else {})}], "PACK",
                "engines' placement group")
            strategy = self._in_group(group)
            devices = self._bundle_devices if r.colocate else None
        return self._actor(EngineRole, self.cfg.to_dict(), model_path, str(log_dir), self.load_args, model_pending,
                           weights_from_push, wait, devices,
                           num_gpus=self._colocated_share() if r.colocate else r.rollout_gpus, strategy=strategy)

    def _bundle_gpus(self, group: Any, gpus: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the GPUs Ray reserved for bundle 0 of ``group`` (``gpus`` of them), from a task
        there that asks for all of them. The trainer's ranks then take one each of those, and the colocated engines,
        given the same list, sit on them too (engine ``i`` on its ``i``-th), not on the node's first ``gpus``."""
        import ray

        task = ray.remote(_visible_devices).options(num_cpus=0, num_gpus=gpus,
                                                    scheduling_strategy=self._in_group(group))
        return ray.get(task.remote())

    def teacher(self, log_dir: Path) -> _RemoteHandle:
        """The teacher's fleet in an actor of its own (GPU engines name their device: ``cuda:N``)."""
        return self._actor(TeacherRole, self.cfg.to_dict(), str(log_dir), self.load_args)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()
        ray.shutdown()


class _RemoteHandle:
    """Calls an actor's methods synchronously (``ray.get``), so the loop reads the same under both. An actor's
    one-line error (a UsageError: a failed run, a bad input) is raised as itself, not inside Ray's ``RayTaskError``
    with the actor's traceback in its text (``--debug`` shows it under the local executor)."""

    def __init__(self, actor: Any):
        self._actor = actor

    def __getattr__(self, name: str):
        method = getattr(self._actor, name)
        return lambda *args, **kwargs: _get(method.remote(*args, **kwargs))


def _get(ref: Any) -> Any:
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UsageError):
            raise exc.cause from exc
        raise


def _visible_devices() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def _cpus() -> int:
    import os

    return os.cpu_count() or 2


EXECUTORS = {"local": LocalExecutor, "ray": RayExecutor}
