"""The executors' placement, without starting Ray: which reservations a Ray run makes, and in what order, when its
engines start before the trainer builds (``engines_before_trainer``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.core.actors.engines import EngineRole
from posttrain.core.config import load_config
from posttrain.core.executors import EXECUTORS, RayExecutor
from posttrain.core.plugins import load_plugins
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def _unstarted(cfg) -> tuple[RayExecutor, list[str], list[tuple]]:
    """A RayExecutor whose placement groups and actors are recorded, not made (no Ray instance)."""
    executor = object.__new__(RayExecutor)
    executor.cfg, executor.load_args = cfg, {}
    executor._actors, executor._groups, executor._trainer_group, executor._bundle_devices = [], [], None, None
    reserved, actors = [], []
    executor._placement = lambda bundles, strategy, what, timeout_s=120.0: reserved.append(what) or (what, bundles)
    executor._actor = lambda cls, *args, num_gpus=0, strategy=None: actors.append((cls, num_gpus, strategy)) or cls
    executor._bundle_gpus = lambda group, gpus: reserved.append(f"{gpus} GPUs of {group[0]}'s bundle 0 probed")
    return executor, reserved, actors


def test_every_executor_says_whether_engines_may_start_first():
    assert {name: cls.engines_before_trainer for name, cls in EXECUTORS.items()} == {"local": True, "ray": True}


@pytest.mark.parametrize("colocate", [False, True])
def test_ray_reserves_the_trainer_group_before_the_engines_that_start_first(plugins, colocate):
    """A trainer group's placement group is made before the engines' (as when the trainer was built first), and
    the trainer's ranks later land on that same group, not on a second one."""
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["resources.executor=ray",
                                                              "resources.trainer_procs_per_node=2",
                                                              f"resources.colocate={str(colocate).lower()}"], plugins)
    executor, reserved, actors = _unstarted(cfg)
    assert executor.engines("/run/hf-init", Path("logs"), model_pending=True) is EngineRole
    if colocate:  # the engine role shares node 0's bundle (one CPU more there)
        assert reserved == ["trainer's placement group"]
        assert executor._trainer_group[1] == [{"CPU": 3.0}]
    else:
        assert reserved == ["trainer's placement group", "engines' placement group"]
        assert executor._trainer_group[1] == [{"CPU": 2.0}]
    (cls, _, strategy), = actors
    assert cls is EngineRole and strategy.placement_group == (executor._trainer_group if colocate else
                                                              ("engines' placement group", [{"CPU": 1.0}]))
    assert executor._trainer_placement() is executor._trainer_group and len(reserved) == (1 if colocate else 2)


def test_ray_engines_of_a_one_rank_trainer_take_no_placement_group(plugins):
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["resources.executor=ray"], plugins)
    executor, reserved, actors = _unstarted(cfg)
    executor.engines("/run/hf-init", Path("logs"), model_pending=True)
    assert reserved == [] and actors == [(EngineRole, cfg.resources.rollout_gpus, None)]


def test_ray_puts_a_colocated_one_rank_trainer_and_its_engines_in_one_bundle(plugins):
    """Colocated, the engine role must run where the trainer's GPU is: on a cluster of several nodes an actor
    without a placement group could land on any of them. Both share one bundle, the engines' actor first."""
    from posttrain.core.actors.trainer import TrainerRole

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["resources.executor=ray", "resources.colocate=true"],
                      plugins)
    executor, reserved, actors = _unstarted(cfg)
    executor.engines("/run/hf-init", Path("logs"), model_pending=True)
    executor.trainer()
    assert reserved == ["trainer's placement group"] and executor._trainer_group[1] == [{"CPU": 2.0}]
    (engine, engine_gpus, engine_at), (trainer, _, trainer_at) = actors
    assert engine is EngineRole and trainer is TrainerRole and engine_gpus == 0
    assert engine_at.placement_group == trainer_at.placement_group == executor._trainer_group
    assert engine_at.placement_group_bundle_index == trainer_at.placement_group_bundle_index == 0


def test_ray_gives_a_colocated_one_rank_trainer_and_its_engines_half_of_one_gpu_each(plugins):
    """On a GPU, each asks for half of the bundle's one GPU, so Ray hands both the same one (the next test runs
    it); a trainer group's engine role asks for none, as before."""
    from posttrain.core.actors.trainer import TrainerRole

    gpu = ["resources.executor=ray", "resources.colocate=true", "resources.trainer_gpus_per_node=1"]
    executor, reserved, actors = _unstarted(load_config(ROOT / "examples" / "quickstart.yaml", gpu, plugins))
    executor.engines("/run/hf-init", Path("logs"), model_pending=True)
    executor.trainer()
    assert executor._trainer_group[1] == [{"CPU": 2.0, "GPU": 1.0}]
    assert [(cls, gpus) for cls, gpus, _ in actors] == [(EngineRole, 0.5), (TrainerRole, 0.5)]
    group = load_config(ROOT / "examples" / "quickstart.yaml", gpu[:2] + ["resources.trainer_gpus_per_node=2"],
                        plugins)
    executor, reserved, actors = _unstarted(group)
    executor.engines("/run/hf-init", Path("logs"), model_pending=True)
    assert actors[0][:2] == (EngineRole, 0)  # it sees the bundle's GPUs, which a probe asks Ray for (next tests)
    assert reserved == ["trainer's placement group", "2 GPUs of trainer's placement group's bundle 0 probed"]


PROBE = """
import os, sys, ray
from posttrain.core import executors
from posttrain.core.config import load_config

class Probe:  # stands in for TrainerRole and EngineRole: what Ray gave the actor
    def __init__(self, *args): pass
    def visible(self): return os.environ.get("CUDA_VISIBLE_DEVICES")

ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
blocker = ray.remote(num_gpus=1)(Probe).remote()  # another job's actor holds the node's first GPU
held = ray.get(blocker.visible.remote())
executors.TrainerRole = executors.EngineRole = Probe
cfg = load_config(sys.argv[1], ["resources.executor=ray", "resources.colocate=true", "resources.trainer_gpus_per_node=1"])
executor = executors.RayExecutor(cfg)
engines = executor.engines("/run/hf-init", "logs", model_pending=True)
trainer = executor.trainer()
print(held, engines.visible(), trainer.visible())
executor.close()
"""


def test_a_colocated_one_rank_trainer_and_its_engines_get_the_same_gpu_from_ray():
    """A Ray instance with four (declared) GPUs, the first held by another actor: the trainer's actor and the
    engine role's get one and the same GPU, not the held one. Ray sets ``CUDA_VISIBLE_DEVICES`` from its own
    resource ids, so no GPU is needed to see its choice."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "examples" / "quickstart.yaml")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    held, engines, trainer = out.stdout.split()[-3:]
    assert engines == trainer and engines != held and engines in {"0", "1", "2", "3"}, out.stdout


GROUP_PROBE = """
import os, sys, ray
from posttrain.core import executors
from posttrain.core.config import load_config

class Probe:  # stands in for EngineRole and the trainer's ranks: the GPUs the actor sees
    def __init__(self, *args):
        if len(args) > 7 and args[7] is not None:  # EngineRole's visible_devices
            os.environ["CUDA_VISIBLE_DEVICES"] = args[7]
    def visible(self): return os.environ.get("CUDA_VISIBLE_DEVICES", "")

ray.init(num_cpus=6, num_gpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
blocker = ray.remote(num_gpus=1)(Probe).remote()  # another job's actor holds one of the node's GPUs
held = ray.get(blocker.visible.remote())
executors.EngineRole = Probe
cfg = load_config(sys.argv[1], ["resources.executor=ray", "resources.colocate=true", "resources.trainer_gpus_per_node=2",
                                "resources.num_engines=2"])
executor = executors.RayExecutor(cfg)
engines_first = sys.argv[2] == "engines-first"
engines = executor.engines("/run/hf-init", "logs", model_pending=True) if engines_first else None
strategy = executor._in_group(executor._trainer_placement())
ranks = [ray.remote(Probe).options(num_cpus=1, num_gpus=1, scheduling_strategy=strategy).remote() for _ in range(2)]
ray.get([r.visible.remote() for r in ranks])  # the ranks hold their GPUs
engines = engines or executor.engines("/run/hf-init", "logs")
print("|".join([held, engines.visible(), ",".join(sorted(ray.get([r.visible.remote() for r in ranks])))]))
executor.close()
"""


@pytest.mark.parametrize("order", ["engines-first", "trainer-first"])
def test_a_colocated_trainer_groups_engines_see_the_gpus_its_ranks_get(order):
    """Two ranks colocated with two engines, on a Ray instance with four (declared) GPUs, one held by another actor:
    the engine role sees exactly the GPUs of the bundle its ranks take (engine ``i`` on the ``i``-th), not the node's
    first two, whichever Ray reserved; also when the ranks hold them already (a backend that cannot wait for its
    checkpoint starts after the trainer). A rank asks for one GPU of the bundle, as ``RayRanks`` does."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GROUP_PROBE, str(ROOT / "examples" / "quickstart.yaml"), order],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    held, engines, ranks = out.stdout.split()[-1].split("|")
    assert sorted(engines.split(",")) == ranks.split(",") and held not in engines.split(","), out.stdout
    assert len(ranks.split(",")) == 2, out.stdout


def test_an_actors_one_line_error_comes_back_as_itself(monkeypatch):
    """Under Ray, an actor's RunFailed (or any UsageError) reaches the loop as itself, so the CLI prints its one line
    (Ray's RayTaskError carries the actor's traceback in its text); other errors stay Ray's."""
    import ray
    from ray.exceptions import RayTaskError

    from posttrain.core.errors import RunFailed
    from posttrain.core.executors import _RemoteHandle

    failures = {"train": RunFailed("trainer: out of GPU memory in the train pass"), "push": ValueError("bad bucket")}

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args, **kwargs):
            return self.name

    def get(name):
        raise RayTaskError(name, "Traceback (most recent call last): ...", failures[name], proctitle="actor", pid=1,
                           ip="127.0.0.1")
    monkeypatch.setattr(ray, "get", get)
    handle = _RemoteHandle(type("Actor", (), {"train": Method("train"), "push": Method("push")})())
    with pytest.raises(RunFailed) as caught:
        handle.train()
    assert str(caught.value) == "trainer: out of GPU memory in the train pass" and caught.value.exit_code == 1
    with pytest.raises(RayTaskError):
        handle.push()
