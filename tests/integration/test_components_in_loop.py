"""Every registered estimator, loss and correction through the real loop, two steps each on the tiny model.

A component whose unit contract passes can still crash in the loop (an input the loop never supplies,
a metric it cannot log): this runs each one with the others at their quickstart defaults. One engine is
started for the module and reached as an ``external`` backend (weights pushed from disk at every step),
so a case costs the trainer's build and two steps, not an engine start.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _names(kind):
    from posttrain.core.plugins import load_plugins

    return sorted(load_plugins(autoload=False).registry(kind))


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    from posttrain.testing.engine import start_local_engine
    from posttrain.testing.tiny import make_tiny_checkpoint

    import os

    from posttrain.core.rollout.backend import API_KEY_ENV

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "qwen3", family="qwen3", seed=0)
    server = start_local_engine(ckpt, context_length=64, max_running_requests=16)
    before = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = server.api_key  # the external backend reads the engines' key from there
    yield server.base_url
    server.stop()
    if before is None:
        os.environ.pop(API_KEY_ENV, None)
    else:
        os.environ[API_KEY_ENV] = before


def _run(tmp_path, engine_url, phases=None, **sections):
    from posttrain.core.loop import train
    from posttrain.core.run_dir import RunDirectory

    cfg, plugins = _config(engine_url, **sections)
    run = RunDirectory.create(tmp_path / "run", "smoke")
    on_phase = None if phases is None else (lambda name, detail="": phases.append(name))
    asyncio.run(train(cfg, plugins, run, on_phase=on_phase))
    return [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]


def _config(engine_url, **sections):
    from posttrain.core.config import load_config
    from posttrain.core.plugins import load_plugins

    data = {
        "seed": 0, "model": {"name": "qwen3", "preset": "tiny", "dtype": "float32", "tokenizer": "char"},
        "data": {"path": str(ROOT / "examples" / "quickstart" / "prompts.jsonl"), "epochs": 10},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollouts": 2, "max_new_tokens": 2,
                    "seed_sampling": True, "use_router": False, "weight_sync": "disk",
                    "engine": {"name": "external", "urls": [engine_url], "device": "cpu"}},
        "generator": "single_turn", "estimator": "grpo", "loss": "ppo_clip", "rewards": [{"name": "exact_match"}],
        "trainer": {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3, "kl_loss_coef": 0.01,
                    "entropy_coef": 0.01, "backend": {"name": "megatron", "sequence_packing": False}},
        "logging": {"tensorboard": False}, **sections}
    plugins = load_plugins(autoload=False)
    return load_config(None, data=data, plugins=plugins), plugins


def _check(rows):
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "rollout/reward_mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["rollout/samples"] == 16


@pytest.mark.parametrize("name", _names("estimator"))
def test_every_estimator_runs_in_the_loop(name, tmp_path, engine_url):
    from posttrain.core.plugins import load_plugins
    from posttrain.core.rollout.backend import API_KEY_ENV

    extra = {}
    if load_plugins(autoload=False).estimators[name].needs.teacher:  # the engine as teacher
        extra["teacher"] = {"engine": {"name": "external", "urls": [engine_url], "device": "cpu",
                                       "api_key_env": API_KEY_ENV}, "use_router": False}
    _check(_run(tmp_path, engine_url, estimator=name, **extra))


@pytest.mark.parametrize("name", _names("loss"))
def test_every_loss_runs_in_the_loop(name, tmp_path, engine_url):
    _check(_run(tmp_path, engine_url, loss=name))


@pytest.mark.parametrize("name", _names("correction"))
def test_every_correction_runs_in_the_loop(name, tmp_path, engine_url):
    rows = _run(tmp_path, engine_url, correction=name)
    _check(rows)
    assert any(k.startswith("correction/") for k in rows[-1]), "a correction reports its metrics"


def test_old_log_probs_from_the_train_step_skip_the_pass_and_change_no_number(tmp_path, engine_url, monkeypatch):
    """trainer.old_log_probs_from_train (issue 17): the loop makes no old-policy log-prob pass, and the two
    seeded steps log the same losses, gradient norms, engine gap and rewards as with the separate pass."""
    from posttrain.core.actors.trainer import TrainerRole

    passes = []
    real = TrainerRole.log_probs
    monkeypatch.setattr(TrainerRole, "log_probs", lambda self, batch, weights=None, with_entropy=False: (
        passes.append(weights), real(self, batch, weights, with_entropy))[1])
    trainer = {"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-3, "entropy_coef": 0.01, "log_kl": True,
               "backend": {"name": "megatron", "sequence_packing": False}}
    rows = {}
    for fused in (False, True):
        passes.clear()
        rows[fused] = _run(tmp_path / str(fused), engine_url, trainer={**trainer, "old_log_probs_from_train": fused})
        assert passes == ([None, "ref"] * 2 if not fused else ["ref"] * 2), passes  # old, ref per step / ref only
    for a, b in zip(rows[False], rows[True]):
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train_rollout_logprob_abs_diff",
                    "rollout/reward_mean", "train/pg/clipfrac", "train/pg/ratio_mean"):
            assert abs(a[key] - b[key]) <= 1e-6, (key, a[key], b[key])
    assert rows[True][0]["perf/tokens_per_s_per_gpu"] > 0


def test_an_offloaded_trainer_is_on_the_device_only_while_the_engines_kv_cache_is_away(tmp_path, engine_url,
                                                                                        monkeypatch):
    """``resources.offload_trainer``: the engines start first and import while the trainer builds, but their
    checkpoint appears only after the trainer's state left (so they load and size themselves, and step 0
    generates, in its room); every time it comes back (the first push, each step's turn, each
    checkpoint, the final export, a resume's load) the engines' KV cache is released, and the cache comes back
    only once the trainer's state is away again. Checkpoints are saved after the step's metrics, as without the
    offload."""
    from posttrain.core.actors.engines import EngineRole
    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.loop import train
    from posttrain.core.run_dir import RunDirectory

    events, state = [], {"kv_away": False, "trainer_away": False}
    init_dir = tmp_path / "run" / "hf-init"

    def record(cls, name, before):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            before(self, *args, **kwargs)
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapped)

    def onload(self):
        if self.offloaded:
            assert state["kv_away"], f"the trainer came back beside the engines' KV cache after {events}"
            events.append("onload")
            state["trainer_away"] = False

    def offload(self):
        if not self.offloaded:
            if "offload" not in events:  # the first: the engines, waiting, have no checkpoint to load yet
                assert not init_dir.exists(), "the engines' checkpoint appeared before the trainer's state left"
            events.append("offload")
            state["trainer_away"] = True

    def tagged(name, away):
        def note(self, tags=None):
            events.append(f"{name} {','.join(tags or ['all'])}")
            if tags is None or "kv_cache" in tags:
                assert away or state["trainer_away"], f"the KV cache came back beside the trainer after {events}"
                state["kv_away"] = away
        return note

    record(TrainerRole, "onload", onload)
    record(TrainerRole, "offload", offload)
    threads = {}  # a step's trainer calls -> the threads they ran on
    for name in ("train", "log_probs", "release_memory"):
        record(TrainerRole, name, lambda self, *a, _n=name, **k: threads.setdefault(_n, set()).add(threading.get_ident()))
    metrics = tmp_path / "run" / "metrics.jsonl"
    record(TrainerRole, "save", lambda self, path: events.append(f"save {len(metrics.read_text().splitlines())}"))
    record(EngineRole, "release_memory", tagged("release", True))
    record(EngineRole, "resume_memory", tagged("resume", False))
    record(EngineRole, "__init__", lambda self, config, model_path, log_dir, load_args=None, model_pending=False, *_: (
        events.append("engines" if model_pending else "engines, on an existing checkpoint")))
    rollout = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollouts": 2, "max_new_tokens": 2,
               "seed_sampling": True, "use_router": False, "weight_sync": "disk",
               "engine": {"name": "local", "device": "cpu", "context_length": 64, "max_running_requests": 16}}
    sections = {"rollout": rollout, "resources": {"colocate": True, "offload_trainer": True},
                "checkpoint": {"interval": 1}}
    phases = []
    rows = _run(tmp_path, engine_url, phases, **sections)  # an engine of the run's own: external ones cannot be colocated
    _check(rows)
    assert events[:2] == ["engines", "offload"] and init_dir.is_dir(), events
    assert not (tmp_path / "run" / "hf-init.staged").exists()
    # every step's trainer calls on one thread of their own: one cuBLAS handle and workspace, not one per pool thread
    assert len(set.union(*threads.values())) == 1 and threading.get_ident() not in threads["train"], threads
    assert phases[:5] == ["model", "model_files", "offload", "data", "engines"]  # each start-up part timed apart
    # back for the first push, each step, each checkpoint and the final export; away after each
    assert events.count("onload") == events.count("offload") - 1 == 6, events
    # a step's metrics are on disk before its checkpoint: a kill between them cannot lose the row on resume
    assert [e for e in events if e.startswith("save")] == ["save 1", "save 2"], events
    assert all(r["perf/trainer_offloaded_gib"] > 0 for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_000001",
                                                                                         "step_000002"]

    events.clear()  # resumed from its last checkpoint: the load and the first push, then the final export
    state.update(kv_away=False, trainer_away=False)
    cfg, plugins = _config(engine_url, **sections)
    asyncio.run(train(cfg, plugins, RunDirectory(tmp_path / "run"), resume=True))  # _run holds its lock
    assert events[:2] == ["engines", "offload"] and "release kv_cache" in events, events
    assert events.count("onload") == events.count("offload") - 1 == 2, events
