"""SGLang command lines from the run config, and readiness/restart logic against the local engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from posttrain.core.rollout.backend import API_KEY_ENV
from posttrain.core.rollout.procs import ManagedServer
from posttrain.plugins.engines.sglang.launcher import SGLangSpec, sglang_command, sglang_options_from_argv
from posttrain.plugins.engines.local import LocalEngine, local_engine_command
from posttrain.core.rollout.procs import free_port, http_ok


def test_sglang_command_line_carries_every_option():
    spec = SGLangSpec(model_path="/ckpt", port=30001, tp_size=2, dp_size=2, mem_fraction_static=0.7,
                      enable_memory_saver=True, random_seed=42,
                      extra={"attention_backend": "fa3", "enable_metrics": True, "disable_radix_cache": False,
                             "cuda_graph_bs": [1, 2, 4]})
    cmd = sglang_command(spec, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    pairs = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert pairs["--model-path"] == "/ckpt" and pairs["--port"] == "30001" and pairs["--host"] == "127.0.0.1"
    assert pairs["--tp-size"] == "2" and pairs["--dp-size"] == "2" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--attention-backend"] == "fa3" and pairs["--random-seed"] == "42"
    assert "--enable-memory-saver" in cmd and "--enable-metrics" in cmd and "--skip-server-warmup" in cmd
    assert "--disable-radix-cache" not in cmd
    i = cmd.index("--cuda-graph-bs")
    assert cmd[i + 1:i + 4] == ["1", "2", "4"]
    assert "--enable-memory-saver" not in sglang_command(SGLangSpec(model_path="/ckpt"))


def test_sglang_options_come_from_the_command_line_and_may_not_shadow_the_config():
    opts, rest = sglang_options_from_argv(["run", "--sglang-attention-backend", "fa3", "--sglang-enable-metrics",
                                           "--sglang-chunked-prefill-size=4096", "cfg.yaml"])
    assert opts == {"attention_backend": "fa3", "enable_metrics": True, "chunked_prefill_size": "4096"}
    assert rest == ["run", "cfg.yaml"]
    with pytest.raises(ValueError, match="tp_size"):
        sglang_command(SGLangSpec(model_path="/m", extra={"tp-size": 4}))


@pytest.mark.slow
def test_managed_server_waits_for_readiness_and_restarts_a_dead_server(tiny_ckpt, tmp_path):
    port = free_port()
    cmd = local_engine_command(str(tiny_ckpt), port, LocalEngine.Config(context_length=128, max_running_requests=2))
    server = ManagedServer(cmd, f"http://127.0.0.1:{port}", log_path=tmp_path / "engine.log",
                           env={"OMP_NUM_THREADS": "1", API_KEY_ENV: "k"}, ready_timeout_s=120)
    try:
        server.start()
        assert http_ok(server.base_url + "/health_generate")
        assert server.ensure_running() is False  # healthy: left alone
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert server.ensure_running() is True and server.restarts == 1
        assert http_ok(server.base_url + "/health_generate")
    finally:
        server.stop()
    assert not http_ok(server.base_url + "/health", timeout=1)


@pytest.mark.slow
def test_an_engine_launched_before_its_checkpoint_loads_it_once_it_appears(tiny_ckpt, tmp_path):
    """``--wait-for-model`` (what the fleet passes with ``EngineSlot.model_pending``): the server runs and does
    not answer while the directory is missing, then serves the checkpoint renamed into place."""
    import shutil

    model = tmp_path / "hf-init"
    port = free_port()
    cmd = local_engine_command(str(model), port, LocalEngine.Config(context_length=128, max_running_requests=2),
                               wait_for_model=120)
    server = ManagedServer(cmd, f"http://127.0.0.1:{port}", log_path=tmp_path / "engine.log",
                           env={"OMP_NUM_THREADS": "1", API_KEY_ENV: "k"}, ready_timeout_s=120)
    try:
        server.start(wait=False)
        time.sleep(1.0)
        assert server.alive() and not http_ok(server.base_url + "/health", timeout=1)
        shutil.copytree(tiny_ckpt, f"{model}.partial")
        os.replace(f"{model}.partial", model)
        server.wait_ready()
        assert http_ok(server.base_url + "/health_generate")
    finally:
        server.stop()


def test_engine_serve_says_when_its_checkpoint_did_not_appear(tmp_path):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path / "missing"),
                          "--no-api-key", "--wait-for-model", "0.2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "did not appear within --wait-for-model 0.2 s" in out.stderr and "missing" in out.stderr


def test_only_a_backend_that_waits_for_its_checkpoint_is_launched_before_it():
    from posttrain.core.config import ResourcesConfig
    from posttrain.core.rollout.backend import EngineSlot
    from posttrain.core.rollout.fleet import EngineFleet
    from posttrain.plugins.engines.local import LocalEngine
    from posttrain.plugins.engines.sglang import SGLangEngine

    slot = dict(index=0, port=30001, host="127.0.0.1", model_path="/m", seed=0, resources=ResourcesConfig())
    pending = LocalEngine().launch(EngineSlot(**slot, model_pending=True)).command
    assert pending[pending.index("--wait-for-model") + 1] == "3600"
    assert "--wait-for-model" not in LocalEngine().launch(EngineSlot(**slot)).command
    assert LocalEngine.waits_for_checkpoint and not SGLangEngine.waits_for_checkpoint
    with pytest.raises(ValueError, match="'sglang' cannot start before its checkpoint"):
        EngineFleet(None, ResourcesConfig(), SGLangEngine(), "/m").launch(model_pending=True)


def test_backends_that_start_without_weights_say_so_on_their_command_line():
    """``EngineSlot.weights_from_push``: the local engine gets ``--load-format dummy``, and SGLang too unless its
    ``args`` choose how it loads (then it reads weights, and a fleet refuses to start it without them)."""
    from posttrain.core.config import ResourcesConfig
    from posttrain.core.rollout.backend import EngineSlot
    from posttrain.core.rollout.fleet import EngineFleet
    from posttrain.plugins.engines.external import ExternalEngines
    from posttrain.plugins.engines.local import LocalEngine
    from posttrain.plugins.engines.sglang import SGLangEngine

    slot = dict(index=0, port=30001, host="127.0.0.1", model_path="/m", seed=0, resources=ResourcesConfig())
    for backend in (LocalEngine(), SGLangEngine()):
        assert backend.starts_without_weights
        weightless = backend.launch(EngineSlot(**slot, weights_from_push=True)).command
        assert weightless[weightless.index("--load-format") + 1] == "dummy", weightless
        assert "--load-format" not in backend.launch(EngineSlot(**slot)).command
    chosen = SGLangEngine(SGLangEngine.Config(args={"load-format": "safetensors"}))
    assert not chosen.starts_without_weights and ExternalEngines.starts_without_weights  # they read no hf-init
    with pytest.raises(ValueError, match="'sglang' cannot start without weights"):
        EngineFleet(None, ResourcesConfig(), chosen, "/m", weights_from_push=True)


def test_gpu_engines_warm_up_for_the_runs_sampling_unless_a_release_would_drop_their_graphs():
    """``EngineSlot.sampling`` (the fleet's ``run_sampling``: the rollout's sampling_params, seeded as its requests
    are) reaches a local GPU engine as ``--warm-sampling``; not a CPU engine (no graphs to capture), nor a colocated
    one without stable memory (its first release drops the graphs)."""
    import json

    from posttrain.core.config import ResourcesConfig, RolloutConfig
    from posttrain.core.rollout.backend import EngineSlot
    from posttrain.core.rollout.fleet import run_sampling
    from posttrain.plugins.engines.local import LocalEngine

    sampling = run_sampling(RolloutConfig(temperature=0.7, top_p=0.9, max_new_tokens=512, seed_sampling=True), seed=3)
    assert sampling["temperature"] == 0.7 and sampling["top_p"] == 0.9 and sampling["sampling_seed"] == 3
    assert "sampling_seed" not in run_sampling(RolloutConfig(), seed=3) and run_sampling(None, seed=3) is None

    def warm(device, colocate=False, stable_memory=True, warm_up=True):
        backend = LocalEngine(LocalEngine.Config(device=device, stable_memory=stable_memory, warm_up=warm_up))
        cmd = backend.launch(EngineSlot(index=0, port=30001, host="127.0.0.1", model_path="/m", seed=0,
                                        resources=ResourcesConfig(colocate=colocate), sampling=sampling)).command
        return json.loads(cmd[cmd.index("--warm-sampling") + 1]) if "--warm-sampling" in cmd else None

    assert warm("cuda") == sampling and warm("cuda", colocate=True) == sampling
    assert warm("cpu") is None and warm("cuda", colocate=True, stable_memory=False) is None
    assert warm("cuda", stable_memory=False) == sampling  # not colocated: nothing releases its memory
    assert warm("cuda", warm_up=False) is None  # rollout.engine.warm_up: false


def test_engine_serve_without_weights_needs_only_the_config(tmp_path):
    """``--load-format dummy`` reads no safetensors, so a directory without them is no error; one without
    ``config.json`` still is, and an unknown format is one line."""
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path),
                          "--load-format", "dummy"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no config.json" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path),
                          "--load-format", "pt"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--load-format: expected auto or dummy, got 'pt'" in out.stderr


def test_managed_server_reports_a_server_that_exits_before_it_is_ready(tmp_path):
    server = ManagedServer([sys.executable, "-c", "import sys; sys.exit(3)"], f"http://127.0.0.1:{free_port()}",
                           ready_timeout_s=30)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        server.start()


def test_engine_serve_rejects_a_directory_without_a_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no config.json" in out.stderr and "Traceback" not in out.stderr


def test_engine_serve_needs_a_key_from_the_environment(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(tiny_ckpt)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and f"set {API_KEY_ENV}" in out.stderr and "--no-api-key" in out.stderr


def test_backends_hand_the_key_over_by_environment_never_argv():
    from posttrain.core.config import ResourcesConfig
    from posttrain.core.rollout.backend import EngineSlot
    from posttrain.plugins.engines.local import LocalEngine
    from posttrain.plugins.engines.sglang import SGLangEngine
    from posttrain.plugins.engines.sglang.serve import sglang_argv

    slot = EngineSlot(index=0, port=30001, host="127.0.0.1", model_path="/m", seed=0,
                      resources=ResourcesConfig(), gpus=[0], api_key="k-SECRET")
    for backend in (LocalEngine(), SGLangEngine()):
        launch = backend.launch(slot)
        assert launch.env[API_KEY_ENV] == "k-SECRET"
        assert not any("SECRET" in arg for arg in launch.command), launch.command
        assert "k-SECRET" not in repr(slot)
    sglang = SGLangEngine().launch(slot).command
    assert sglang[1:3] == ["-m", "posttrain.plugins.engines.sglang.serve"] and "--api-key" not in sglang
    assert sglang_argv(sglang[3:], "k-SECRET")[-2:] == ["--api-key", "k-SECRET"]  # inside that process only
    assert sglang_argv(["--port", "1"], None) == ["sglang.launch_server", "--port", "1"]


def test_sglang_spec_from_the_run_config():
    from posttrain.core.config import load_config
    from posttrain.plugins.engines.sglang.launcher import sglang_spec_from_config

    cfg = load_config(None, ["rollout.engine.name=sglang", "rollout.engine.args.attention_backend=fa3",
                             "rollout.engine.mem_fraction_static=0.6"],
                      data={"estimator": "grpo", "trainer": {"global_batch_size": 64},
                            "resources": {"gpus_per_engine": 2, "colocate": True}})
    spec = sglang_spec_from_config(cfg.rollout.engine.config, cfg.resources, "/m", 30002, engine_index=3, seed=10,
                                   cli_options={"enable_metrics": True})
    cmd = sglang_command(spec)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "6"  # colocated: engine 3 of 2 GPUs each starts at GPU 6
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--mem-fraction-static") + 1] == "0.6"
    assert cmd[cmd.index("--random-seed") + 1] == "16" and "--enable-memory-saver" in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "fa3" and "--enable-metrics" in cmd


def test_a_spawned_server_exits_once_its_parent_is_gone_without_pdeathsig():
    """``exit_with_parent``: the child of a parent that exits goes too, though nothing set
    PR_SET_PDEATHSIG for it (plain Popen here): a kill -9 of a run leaves no engine or rank behind."""
    import psutil

    child = ("import time; from posttrain.core.rollout.procs import exit_with_parent; exit_with_parent(0.05); "
             "time.sleep(60)")
    parent = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
              "env={**os.environ, 'POSTTRAIN_PARENT_PID': str(os.getpid())}); print(p.pid, flush=True); time.sleep(2)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "the child outlived its parent"


@pytest.mark.parametrize("hooked", [True, False])
def test_a_forked_worker_dies_with_a_parent_killed_mid_save(hooked):
    """``forks_die_with_parent``: a multiprocessing fork worker (as Megatron's checkpoint writers are) of a
    process killed with SIGKILL is killed too; without the hook it lives on, parented to init."""
    import psutil

    parent = ("import multiprocessing as mp, os, time; from posttrain.core.rollout import procs; "
              f"{'procs.forks_die_with_parent(); ' if hooked else ''}"
              "p = mp.get_context('fork').Process(target=time.sleep, args=(60,)); p.start(); "
              "print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    worker = psutil.Process(int(proc.stdout.readline()))
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        assert alive != hooked, "the worker outlived its killed parent" if hooked else "the control died anyway"
    finally:
        if worker.is_running():
            worker.kill()
