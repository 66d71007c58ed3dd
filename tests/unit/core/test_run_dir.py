"""The run directory: one writer at a time, secrets kept out of what it shares, resume refusing another
model's checkpoint and naming config changes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import yaml

from posttrain.core.errors import UsageError
from posttrain.core.run_dir import RunDirectory, config_changes, hf_shapes
from posttrain.core.secrets import REDACTED, merge, split


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from posttrain.core.run_dir import RunDirectory; "
        f"RunDirectory.create({str(tmp_path / 'run')!r}, 'x'); print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for attempt in (lambda: RunDirectory(tmp_path / "run").lock(),
                        lambda: RunDirectory.create(tmp_path / "run", "x")):
            with pytest.raises(UsageError, match=f"in use by another process \\(PID {holder.pid}\\)"):
                attempt()
    finally:
        holder.kill()
        holder.wait()
    run = RunDirectory(tmp_path / "run").lock()  # the kernel released the dead holder's lock
    assert (tmp_path / "run" / ".lock").read_text() == str(os.getpid())
    run.unlock()


def test_create_refuses_a_used_directory_but_not_a_lone_lock_file(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".lock").write_text("12345")  # a writer that died before writing anything
    run = RunDirectory.create(tmp_path / "r", "x")
    run.unlock()
    with pytest.raises(UsageError, match="exists and is not empty"):
        RunDirectory.create(tmp_path / "r", "y")


CONFIG = {"rewards": [{"name": "remote", "url": "http://rm", "headers": {"Authorization": "Bearer tok-123",
                                                                          "X-Trace": "a"}, "weight": 1.0}],
          "rollout": {"engine": {"name": "external", "api_key_env": "MY_KEY"}, "max_new_tokens": 8},
          "logging": {"wandb_api_key": "wk-9"}, "trainer": {"lr": 1e-6}}


def test_secrets_are_redacted_in_config_yaml_and_come_back_on_resume(tmp_path):
    class Plugins:
        infos = {}

    run = RunDirectory.create(tmp_path / "r", "x")
    run.write_config(CONFIG, Plugins())
    text = (tmp_path / "r" / "config.yaml").read_text()
    assert "tok-123" not in text and "wk-9" not in text and "Bearer" not in text
    shared = yaml.safe_load(text)
    assert shared["rewards"][0]["headers"] == {"Authorization": REDACTED, "X-Trace": REDACTED}
    assert shared["rollout"]["engine"]["api_key_env"] == "MY_KEY"  # the name of a variable is no secret
    kept = tmp_path / "r" / "secrets.yaml"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert run.read_config() == CONFIG


def test_split_and_merge_round_trip():
    clean, found = split(CONFIG)
    assert found == {"rewards.0.headers.Authorization": "Bearer tok-123", "rewards.0.headers.X-Trace": "a",
                     "logging.wandb_api_key": "wk-9"}
    assert merge(clean, found) == CONFIG
    assert split({"max_new_tokens": 3, "stop_token_ids": [1], "tokenizer": "char"})[1] == {}


def test_wandb_gets_the_redacted_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from posttrain.core.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=False, wandb=True, config=CONFIG)
    try:
        sent = dict(writer._wandb.config)
    finally:
        writer.close()
    assert sent["rewards"][0]["headers"]["Authorization"] == REDACTED
    assert "tok-123" not in json.dumps(sent) and "wk-9" not in json.dumps(sent)


def _hf(directory, shapes):
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(directory / "model.safetensors"))
    return directory


def test_resume_refuses_another_models_checkpoint_and_names_changes(tmp_path, caplog):
    run = RunDirectory.create(tmp_path / "r", "x")
    _hf(run.path / "hf-init", {"embed": [8, 4], "layer.0": [4, 4]})
    config = {"model": {"name": "qwen3", "preset": "tiny"}, "trainer": {"lr": 1e-6}}
    ckpt = run.save_checkpoint(3, lambda d: os.makedirs(d), {"config": config}, keep=2)
    assert json.loads((ckpt / "state.json").read_text())["model_shapes"] == {"embed": [8, 4], "layer.0": [4, 4]}

    same = _hf(tmp_path / "same", {"embed": [8, 4], "layer.0": [4, 4]})
    changed = {**config, "trainer": {"lr": 2e-6}}
    with caplog.at_level("WARNING"):
        assert run.check_resume(ckpt, changed, same) == ["trainer.lr: 1e-06 -> 2e-06"]
    assert "config changed since step_000003: trainer.lr: 1e-06 -> 2e-06" in caplog.text

    wider = _hf(tmp_path / "wider", {"embed": [8, 8], "layer.0": [4, 4]})
    with pytest.raises(UsageError, match=r"another model than the config: tensor embed: \[8, 4\] in the checkpoint, "
                                         r"\[8, 8\] in this model"):
        run.check_resume(ckpt, config, wider)
    with pytest.raises(UsageError, match="model.name: 'qwen3' -> 'llama3'"):
        run.check_resume(ckpt, {**config, "model": {"name": "llama3", "preset": "tiny"}}, same)


def test_resume_compares_the_models_config_where_hf_init_holds_no_weights(tmp_path):
    """A run's hf-init holds config.json and the tokenizer alone (core.hf_init): its config stands for the shapes."""
    run = RunDirectory.create(tmp_path / "r", "x")
    (run.path / "hf-init").mkdir()
    (run.path / "hf-init" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    config = {"model": {"name": "qwen3", "path": "/ckpt"}}
    ckpt = run.save_checkpoint(1, lambda d: os.makedirs(d), {"config": config}, keep=2)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["model_shapes"] == {} and state["model_config"]["hidden_size"] == 64
    same = tmp_path / "same"
    same.mkdir()
    (same / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    assert run.check_resume(ckpt, config, same) == []
    (same / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 2}))
    with pytest.raises(UsageError, match=r"another model than the config: config.json hidden_size: 64 in the "
                                         r"checkpoint, 128 in this model \(1 differ\)"):
        run.check_resume(ckpt, config, same)


def test_config_changes_walk_lists_and_new_keys():
    assert config_changes({"a": [{"w": 1}], "b": 1}, {"a": [{"w": 2}], "b": 1, "c": 3}) == ["a.0.w: 1 -> 2",
                                                                                        "c: None -> 3"]
    assert hf_shapes("/nonexistent") == {}


def test_dry_run_prints_secrets_redacted():
    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(ROOT / "examples" / "quickstart.yaml"),
                          "--dry-run", 'rewards=[{name: remote, url: "http://x/r", headers: {Authorization: "Bearer sk-1"}}]'],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Authorization: <redacted>" in out.stdout and "sk-1" not in out.stdout + out.stderr


def test_steps_are_counted_from_one_in_checkpoints_and_logs(tmp_path):
    """Step N (the console's "step N/T") is ``"step": N`` in rollouts.jsonl and ``step_00000N`` after it;
    ``state.json`` holds the steps done; a resume after N steps keeps the rows of steps 1..N."""
    run = RunDirectory.create(tmp_path / "r", "x")
    for n in (1, 2, 3):
        run.log_rollouts(n, [], [])
        run.save_checkpoint(n, lambda d: os.makedirs(d), {"buffer": {}}, keep=2)
    assert sorted(p.name for p in run.checkpoints.glob("step_*")) == ["step_000002", "step_000003"]
    latest = run.latest_checkpoint()
    assert latest.name == "step_000003" and json.loads((latest / "state.json").read_text())["steps"] == 3
    assert run.checkpoint_step(latest) == 3 and run.load_checkpoint(latest)["steps"] == 3
    assert run.checkpoints_by_step() == {2: run.checkpoints / "step_000002", 3: latest}
    assert run.checkpoint_after(2).name == "step_000002"
    run.truncate_after(2)
    assert [json.loads(line)["step"] for line in (run.path / "rollouts.jsonl").read_text().splitlines()] == [1, 2]


def test_a_checkpoint_from_before_one_based_steps_reads_as_the_steps_it_holds(tmp_path):
    """``state.json`` of older checkpoints stored the 0-based index of their last step (``"step": 9`` after
    10 steps): read as 10 steps, so their resume neither repeats nor skips a step."""
    run = RunDirectory(tmp_path / "r")
    old = run.checkpoints / "step_000009"
    old.mkdir(parents=True)
    (old / "state.json").write_text(json.dumps({"step": 9, "buffer": {}, "rng": None}))
    assert run.checkpoint_step(old) == 10 and run.checkpoints_by_step() == {10: old}
