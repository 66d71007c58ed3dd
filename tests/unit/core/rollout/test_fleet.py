"""EngineFleet: engines and the real router from the run config; a dead engine is restarted and re-registered."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from posttrain.core.config import load_config
from posttrain.core.rollout.fleet import EngineFleet


def config(engine=None, **rollout):
    engine = engine or {"name": "local", "context_length": 128, "max_running_requests": 4}
    return load_config(None, [], data={"estimator": "grpo", "trainer": {"global_batch_size": 64},
                                       "rollout": {"engine": engine, **rollout}, "resources": {"num_engines": 2}})


def fleet_of(cfg, model_path, **kw):
    return EngineFleet(cfg.rollout, cfg.resources, cfg.rollout.engine.create(), model_path, **kw)


@pytest.mark.slow
def test_fleet_of_two_local_engines_behind_the_router_restarts_a_dead_one(tiny_ckpt, tmp_path):
    cfg = config()
    fleet = fleet_of(cfg, str(tiny_ckpt), log_dir=tmp_path, env={"OMP_NUM_THREADS": "1"})

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
    from posttrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine.urls: the external backend needs at least one URL"):
        config({"name": "external"})
    cfg = config({"name": "external", "urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}, use_router=False)
    fleet = fleet_of(cfg, "/m").start()
    with pytest.raises(ValueError, match="use_router"):
        fleet.url
    cfg = config({"name": "external", "urls": ["http://127.0.0.1:1/"]}, use_router=False)
    assert fleet_of(cfg, "/m").start().url == "http://127.0.0.1:1"


@pytest.mark.parametrize("colocate, device, expect", [(False, "cuda", ["1", "2"]), (True, "cuda", ["0", "1"]),
                                                      (False, "cuda:3", ["3", "3"])])
def test_engines_get_their_gpu_after_the_trainers(colocate, device, expect, monkeypatch):
    """Disaggregated engines start after the trainer's GPUs; each sees its GPU alone (as cuda:0)."""
    from posttrain.core.config import ResourcesConfig, RolloutConfig
    from posttrain.plugins.engines.local import LocalEngine

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fleet = EngineFleet(RolloutConfig(), ResourcesConfig(trainer_gpus_per_node=1, num_engines=2, colocate=colocate),
                        LocalEngine(LocalEngine.Config(device=device)), model_path="/m")
    servers = [fleet._server(i) for i in range(2)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == expect
    assert all(s.command[s.command.index("--device") + 1] == "cuda" for s in servers)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the parent's own list maps the indices
    assert fleet._server(0).env["CUDA_VISIBLE_DEVICES"] == str(4 + int(expect[0]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES has 1 GPU"):
        fleet._server(1)


@pytest.mark.slow
def test_an_engine_whose_port_was_taken_before_it_bound_starts_on_a_fresh_one(tiny_ckpt, tmp_path, monkeypatch):
    """``free_port`` hands out a port nobody holds *now*; another process may bind it before the engine
    does (seconds later, after loading the model). The fleet then starts that engine again on a fresh
    port instead of failing the run."""
    import socket

    from posttrain.core.rollout import fleet as fleet_mod

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    ports = iter([taken])
    real = fleet_mod.free_port
    monkeypatch.setattr(fleet_mod, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    cfg = config()
    cfg.resources.num_engines = 1
    fleet = fleet_of(cfg, str(tiny_ckpt), log_dir=tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        with fleet:
            (url,) = fleet.engine_urls
            assert not url.endswith(f":{taken}")
            assert fleet.servers[0].healthy()
    finally:
        holder.close()


def test_an_engine_that_exits_while_starting_is_one_line_naming_its_log_and_its_last_words(tmp_path):
    """An engine that dies before it answers (here: no checkpoint where it was pointed) ends the start with a
    RunFailed (one line, exit code 1): the engine, how it ended, its log and the log's last line. The fleet is
    stopped."""
    from posttrain.core.errors import RunFailed

    missing = tmp_path / "no-checkpoint"
    fleet = fleet_of(config(use_router=False), str(missing), log_dir=tmp_path)  # two engines: the first fails first
    with pytest.raises(RunFailed) as caught:
        fleet.start()
    text = str(caught.value)
    assert caught.value.exit_code == 1 and "\n" not in text
    assert text.startswith("engine 0: process exited with code 2 before ") and "answered" in text
    assert text.endswith(f"its log: {tmp_path / 'engine-0.log'}: error: {missing}: not a HF checkpoint directory "
                         "(no config.json)"), text
    assert all(s.proc is None for s in fleet.servers)


def test_a_bind_failure_is_read_from_the_engines_log_even_once_the_port_is_free_again(tmp_path):
    """A port held only for a moment (another process's probe, a client's ephemeral port) is free again when
    the fleet looks; the engine's log still says why it exited, and that alone earns the fresh port."""
    from types import SimpleNamespace

    from posttrain.core.rollout.fleet import _bind_failed

    log = tmp_path / "engine-0.log"
    log.write_text("loading\nOSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 34497): "
                   "address already in use\n")
    assert _bind_failed(SimpleNamespace(log_path=log))
    log.write_text("error: no config.json\n")
    assert not _bind_failed(SimpleNamespace(log_path=log))
    assert not _bind_failed(SimpleNamespace(log_path=tmp_path / "none.log"))
    assert not _bind_failed(SimpleNamespace(log_path=None))
