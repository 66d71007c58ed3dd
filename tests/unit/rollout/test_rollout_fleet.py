"""EngineFleet: engines and the real router from the run config; a dead engine is restarted and re-registered."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from posttrain.core.config import load_config
from posttrain.core.rollout.fleet import EngineFleet


def config(**rollout):
    return load_config(None, [], data={"estimator": "grpo", "trainer": {"global_batch_size": 64},
                                       "rollout": {"engine_context_length": 128, "engine_max_running_requests": 4,
                                                   **rollout},
                                       "resources": {"num_engines": 2}})


@pytest.mark.slow
def test_fleet_of_two_local_engines_behind_the_router_restarts_a_dead_one(tiny_ckpt, tmp_path):
    cfg = config()
    fleet = EngineFleet(cfg.rollout, cfg.resources, str(tiny_ckpt), log_dir=tmp_path,
                        env={"OMP_NUM_THREADS": "1"})

    async def generate_all(n):
        async with fleet.client() as engine:
            outs = await asyncio.gather(*[engine.generate(input_ids=[5, i + 6], sampling_params={"max_new_tokens": 4})
                                          for i in range(n)])
        return [o["meta_info"]["completion_tokens"] for o in outs]

    with fleet:
        assert fleet.url == fleet.router.url and len(fleet.engine_urls) == 2
        assert {w["url"] for w in fleet.router.workers()} == set(fleet.engine_urls)
        assert all(0 < n <= 4 for n in asyncio.run(generate_all(6)))
        assert fleet.check_and_restart() == []
        dead = fleet.servers[1]
        os.killpg(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)
        assert fleet.check_and_restart() == [dead.base_url]
        assert {w["url"] for w in fleet.router.workers() if w["is_healthy"]} == set(fleet.engine_urls)
        assert all(0 < n <= 4 for n in asyncio.run(generate_all(6)))
        sender = fleet.weight_sender()
        assert sender.engine_urls == fleet.engine_urls and sender.world_size == 3
    assert fleet.router is None and all(s.proc is None for s in fleet.servers)


def test_external_engines_need_urls_and_several_engines_need_the_router():
    cfg = config(engine="external")
    with pytest.raises(ValueError, match="engine_urls"):
        EngineFleet(cfg.rollout, cfg.resources, "/m").start()
    cfg = config(engine="external", engine_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], use_router=False)
    fleet = EngineFleet(cfg.rollout, cfg.resources, "/m").start()
    with pytest.raises(ValueError, match="use_router"):
        fleet.url
    cfg = config(engine="external", engine_urls=["http://127.0.0.1:1/"], use_router=False)
    assert EngineFleet(cfg.rollout, cfg.resources, "/m").start().url == "http://127.0.0.1:1"
