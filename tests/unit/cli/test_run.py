"""`--resume`, `--resume-or-start` and Ctrl-C, through `rl-cli run` in-process with the training loop
replaced (``posttrain.cli.run.start_training``), so they take a second, not a run."""

import json
import sys

import pytest
import yaml

from posttrain.cli import run as run_cmd
from posttrain.cli.main import main
from posttrain.core.config import load_config

from tests.conftest import ROOT

QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def rl_cli(monkeypatch, capsys, *args):
    """(exit code, stdout, stderr) of `rl-cli ARGS` run in this process."""
    monkeypatch.setattr(sys, "argv", ["rl-cli", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def calls(monkeypatch):
    """The start_training calls, each as its keyword arguments (and the run directory)."""
    seen = []

    def fake(cfg, plugins, run, **kwargs):
        seen.append({"cfg": cfg, "run": run, **kwargs})

    monkeypatch.setattr(run_cmd, "start_training", fake)
    return seen


def make_run_dir(path, checkpoint_steps=None, interval=0):
    """A run directory as `rl-cli run` leaves it: config.yaml, metrics, and optionally the checkpoint written
    after ``checkpoint_steps`` steps."""
    cfg = load_config(QUICKSTART).to_dict()
    cfg["checkpoint"]["interval"] = interval
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.1}) + "\n")
    if checkpoint_steps is not None:
        ckpt = path / "checkpoints" / f"step_{checkpoint_steps:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"steps": checkpoint_steps}))
        (path / "checkpoints" / "latest").write_text(ckpt.name)
    return path


def test_resume_without_checkpoint_exits_2_with_the_reason(tmp_path, monkeypatch, capsys, calls):
    run = make_run_dir(tmp_path / "r", interval=0)
    code, _, err = rl_cli(monkeypatch, capsys, "run", "--resume", run)
    assert code == 2 and not calls
    assert "nothing to resume, no checkpoint there: its config has checkpoint.interval: 0" in err
    assert f"rl-cli run --resume-or-start {run}" in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_text().count("\n") == 1  # untouched

    run = make_run_dir(tmp_path / "r2", interval=10)
    code, _, err = rl_cli(monkeypatch, capsys, "run", "--resume", run)
    assert code == 2 and "stopped before its first checkpoint (checkpoint.interval: 10)" in err


def test_resume_says_which_step_and_checkpoint(tmp_path, monkeypatch, capsys, calls):
    run = make_run_dir(tmp_path / "r", checkpoint_steps=5, interval=5)
    code, out, err = rl_cli(monkeypatch, capsys, "run", "--resume", run, "rollout.num_rollouts=7")
    assert code == 0, err
    assert f"resumed after step 5 (checkpoint {run / 'checkpoints' / 'step_000005'})" in out
    assert len(calls) == 1 and calls[0]["resume"] is True
    assert calls[0]["cfg"].rollout.num_rollouts == 7  # an override, not taken for the CONFIG argument


def test_resume_or_start_starts_over_without_a_checkpoint(tmp_path, monkeypatch, capsys, calls):
    run = make_run_dir(tmp_path / "r")
    code, out, err = rl_cli(monkeypatch, capsys, "run", "--resume-or-start", run)
    assert code == 0, err
    assert "starting it over from step 1" in out
    assert calls[0]["resume"] is True  # the loop then drops the old metrics (no checkpoint: from step 1)

    fresh = tmp_path / "new"  # a scheduler's first launch: no directory yet
    code, out, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--resume-or-start", fresh)
    assert code == 0, err
    assert calls[1]["resume"] is False and (fresh / "config.yaml").is_file()

    resumable = make_run_dir(tmp_path / "r3", checkpoint_steps=3, interval=1)
    code, out, _ = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--resume-or-start", resumable)
    assert code == 0 and "resumed after step 3" in out


def test_ctrl_c_prints_how_to_resume_and_exits_130(tmp_path, monkeypatch, capsys):
    def interrupted_after_a_checkpoint(cfg, plugins, run, **kwargs):
        kwargs["on_phase"]("train")
        kwargs["on_step"](0, {"rollout/reward_mean": 0.5})
        ckpt = run.checkpoints / "step_000001"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"steps": 1}))
        (run.checkpoints / "latest").write_text(ckpt.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd, "start_training", interrupted_after_a_checkpoint)
    run = tmp_path / "r"
    code, out, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", run)
    assert code == 130
    assert "interrupted at step 2/150" in err
    assert f"resume with: rl-cli run --resume {run}  (continues after step 1, checkpoint {run / 'checkpoints' / 'step_000001'})" in err and "Traceback" not in err


def test_ctrl_c_before_any_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    def interrupted(cfg, plugins, run, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd, "start_training", interrupted)
    code, _, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", tmp_path / "r")
    assert code == 130 and f"rl-cli run --resume-or-start {tmp_path / 'r'}" in err


def test_resume_flags_conflict(tmp_path, monkeypatch, capsys, calls):
    code, _, err = rl_cli(monkeypatch, capsys, "run", "--resume", tmp_path, "--resume-or-start", tmp_path)
    assert code == 2 and "not both" in err


def test_sigterm_stops_the_run_as_ctrl_c_does_with_exit_code_143(tmp_path, monkeypatch, capsys):
    import os
    import signal

    def terminated_after_a_checkpoint(cfg, plugins, run, **kwargs):
        kwargs["on_step"](0, {"rollout/reward_mean": 0.5})
        ckpt = run.checkpoints / "step_000001"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"steps": 1}))
        (run.checkpoints / "latest").write_text(ckpt.name)
        os.kill(os.getpid(), signal.SIGTERM)  # what Slurm and Kubernetes send
        raise AssertionError("SIGTERM did not stop the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(run_cmd, "start_training", terminated_after_a_checkpoint)
    run = tmp_path / "r"
    code, out, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", run)
    assert code == 143 and "terminated (SIGTERM) at step 2/150" in err
    assert f"resume with: rl-cli run --resume {run}  (continues after step 1, checkpoint {run / 'checkpoints' / 'step_000001'})" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) is before  # the CLI leaves the process's handler as it found it


@pytest.mark.parametrize("code_name", ["ENOSPC", "EROFS", "EACCES"])
def test_a_disk_that_fails_under_the_run_ends_in_one_line_with_exit_code_1(tmp_path, monkeypatch, capsys, code_name):
    import errno
    import os

    def failing_write(cfg, plugins, run, **kwargs):
        target = run.checkpoints / ".tmp-step_000002" / "trainer"
        code = getattr(errno, code_name)
        raise RuntimeError("checkpoint failed") from OSError(code, os.strerror(code), str(target))

    monkeypatch.setattr(run_cmd, "start_training", failing_write)
    code, _, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", tmp_path / "r")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    what = {"ENOSPC": "no space left on the device", "EROFS": "read-only file system",
            "EACCES": "permission denied"}[code_name]
    assert f"error: storage: {what} at {tmp_path / 'r'}" in lines[0] and "--resume RUN_DIR" in lines[0]


def test_a_finished_run_is_complete_for_resume_and_never_retrained_by_resume_or_start(tmp_path, monkeypatch, capsys,
                                                                                     calls):
    run = tmp_path / "r"
    code, _, _ = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", run, "checkpoint.interval=0")
    assert code == 0 and len(calls) == 1 and json.loads((run / "complete.json").read_text()) == {"steps": 150}
    for flag in ("--resume", "--resume-or-start"):
        code, out, err = rl_cli(monkeypatch, capsys, "run", flag, run)
        assert code == 0 and f"run complete (150/150): nothing to resume in {run}" in out, out + err
    assert len(calls) == 1  # neither started training again
    # more steps than it trained, and no checkpoint to go on from: one line, exit 2, nothing started
    code, _, err = rl_cli(monkeypatch, capsys, "run", "--resume", run, "rollout.num_rollouts=160")
    assert code == 2 and "finished after 150 steps with no checkpoint to continue from to 160" in err
    assert len(calls) == 1


def test_a_finished_run_with_a_checkpoint_goes_on_when_asked_for_more_steps(tmp_path, monkeypatch, capsys, calls):
    run = make_run_dir(tmp_path / "r", checkpoint_steps=150, interval=50)
    (run / "complete.json").write_text(json.dumps({"steps": 150}))
    code, out, err = rl_cli(monkeypatch, capsys, "run", "--resume", run, "rollout.num_rollouts=160")
    assert code == 0 and len(calls) == 1 and calls[0]["resume"] is True, out + err
    assert json.loads((run / "complete.json").read_text()) == {"steps": 160}


def test_exact_line_names_the_step_as_the_metrics_and_console_count_it():
    exact_line = run_cmd.exact_line
    key, toks = "train_rollout_logprob_abs_diff_max", "train_rollout_logprob_tokens"
    rows = [{"step": 1, key: 0.0, toks: 8.0}, {"step": 2, key: 0.25, toks: 8.0, "train_rollout_logprob_abs_diff": 0.01}]
    assert exact_line(rows[:1]) == "exact: every token matched (8 tokens, 1 steps)"
    assert exact_line(rows).startswith("exact: step 2 did not match: max |train - rollout| log-prob 0.25 (mean 0.01)")
    assert exact_line([{"step": 1}]) == "exact: no step compared train and rollout log-probs"


def test_a_placement_this_machine_lacks_gpus_for_ends_in_one_line_before_anything_starts(tmp_path, monkeypatch,
                                                                                         capsys, calls):
    """The GPU example's disaggregated placement on a machine of fewer GPUs: exit 2 naming the shortfall, no run
    directory, nothing started; on one GPU the line says how to colocate."""
    code, _, err = rl_cli(monkeypatch, capsys, "run", QUICKSTART, "--run-dir", tmp_path / "r",
                          "resources.trainer_gpus_per_node=1", "rollout.engine.device=cuda")
    assert code == 2 and not calls and not (tmp_path / "r").exists()
    assert "resources: the placement needs 2 GPU(s) (trainer 1, engines on [1]), this machine has 0" in err
    assert "Traceback" not in err

    from posttrain.core.plugins import load_plugins
    from posttrain.core.rollout.backend import gpu_shortfall

    plugins = load_plugins()
    cfg = load_config(QUICKSTART, ["resources.trainer_gpus_per_node=1", "rollout.engine.device=cuda"], plugins)
    engine = cfg.rollout.engine.create(plugins)
    assert gpu_shortfall(cfg.resources, engine, 1).endswith(
        "this machine has 1; on one GPU add resources.colocate=true (the engines share the trainer's GPU)")
    assert gpu_shortfall(cfg.resources, engine, 2) is None
    colocated = load_config(QUICKSTART, ["resources.trainer_gpus_per_node=1", "rollout.engine.device=cuda",
                                         "resources.colocate=true"], plugins)
    assert gpu_shortfall(colocated.resources, colocated.rollout.engine.create(plugins), 1) is None
