"""The start-up order and the memory plan as named states, checked without starting anything."""

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from posttrain.core.memory_plan import MemoryPlan
from posttrain.core.metrics import PhaseTimer
from posttrain.core.startup import EngineStart, InitCheckpoint, StartupOrder

CASES = list(itertools.product([False, True], repeat=6))


@pytest.mark.parametrize("waits,weightless_backend,before_trainer,hf_init_weights,colocate,offload", CASES)
def test_the_order_follows_the_backend_the_executor_and_the_config(waits, weightless_backend, before_trainer,
                                                                   hf_init_weights, colocate, offload):
    """Model files alone come before the trainer only when the engines need not size beside it; engines launch
    before the trainer when the executor allows it and they have something to start on (model files) or can
    wait for it; they wait for a checkpoint written under ``hf-init.staged`` when the trainer offloads."""
    backend = SimpleNamespace(waits_for_checkpoint=waits, starts_without_weights=weightless_backend)
    order = StartupOrder.decide(backend, before_trainer, hf_init_weights, colocate, offload)
    weightless = weightless_backend and not hf_init_weights
    assert order.weights_from_push == weightless
    assert (order.init is InitCheckpoint.TRAINER_WEIGHTS) == (not weightless)
    assert (order.init is InitCheckpoint.FILES_BEFORE_TRAINER) == (weightless and not colocate)
    files_first = order.init is InitCheckpoint.FILES_BEFORE_TRAINER
    assert order.engines_first == (before_trainer and (files_first or waits))
    assert (order.engines is EngineStart.AWAITING_CHECKPOINT) == (order.engines_first and waits)
    assert (order.engines is EngineStart.ON_MODEL_FILES) == (order.engines_first and not waits)
    assert order.staged == (offload and order.engines_first)


class _Recorder:
    """A trainer or engine role that records its memory moves."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getattr__(self, method):
        def call(*args):
            self.log.append(f"{self.name}.{method}{'' if not args else ' ' + ','.join(args[0])}")
            return 1.5
        return call


def _plan(colocate, offload):
    log = []

    async def on_trainer(fn, *args):
        return fn(*args)
    return MemoryPlan(colocate, offload, _Recorder("trainer", log), _Recorder("engines", log), on_trainer), log


def test_a_colocated_offloaded_step_hands_the_gpus_over_in_order():
    """The trainer's turn: the engines release everything, the trainer's state comes back; then room for the
    engines' weights, the push, the trainer's state away, and the engines' KV cache last."""
    plan, log = _plan(colocate=True, offload=True)
    timer = PhaseTimer()

    async def step():
        await plan.trainer_turn(timer)
        log.append("train")

        async def push():
            log.append("push")
            return "pushed"
        return await plan.engines_turn(timer, push)
    assert asyncio.run(step()) == ("pushed", 1.5)
    assert log == ["engines.release_memory", "trainer.onload", "train", "trainer.release_memory",
                   "engines.resume_memory weights", "push", "trainer.offload", "engines.resume_memory kv_cache"]
    assert {"perf/time_release", "perf/time_onload", "perf/time_sync", "perf/time_offload"} <= set(timer.pop())


def test_checkpoints_and_the_first_push_bring_the_trainer_back_only_beside_the_engines_weights():
    plan, log = _plan(colocate=True, offload=True)
    with plan.around_first_push():
        log.append("push")
    with plan.around_checkpoint():
        log.append("save")
    assert log == ["engines.release_memory kv_cache", "push", "trainer.offload", "engines.resume_memory kv_cache",
                   "engines.release_memory kv_cache", "save", "engines.resume_memory kv_cache"]


def test_without_colocation_nothing_moves():
    plan, log = _plan(colocate=False, offload=False)

    async def step():
        await plan.trainer_turn(PhaseTimer())

        async def push():
            return "pushed"
        out = await plan.engines_turn(PhaseTimer(), push)
        await plan.before_export()
        return out
    with plan.around_first_push(), plan.around_checkpoint():
        pass
    assert asyncio.run(step()) == ("pushed", None) and log == []
