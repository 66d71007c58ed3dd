"""What a new user got wrong first (issue #20): each mistake is one error line from `rl-cli run`, exit
code 2, no traceback, before any process starts (the run directory is never created)."""

import json
import subprocess
import sys

import pytest

from posttrain.core.data import preview

GOOD = {
    "model": {"name": "qwen3", "preset": "tiny", "dtype": "float32", "tokenizer": "char"},
    "data": {"path": "prompts.jsonl"},
    "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollouts": 2},
    "generator": "single_turn", "estimator": "grpo", "loss": "ppo_clip",
    "rewards": [{"name": "exact_match"}],
    "trainer": {"global_batch_size": 4, "micro_batch_size": 4},
}
ROWS = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(5)]


def rl_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


@pytest.fixture
def project(tmp_path):
    """make(config changes) -> config path, next to a 5-row prompts.jsonl."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(drop=(), **sections):
        cfg = {k: v for k, v in GOOD.items() if k not in drop}
        for key, value in sections.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
        path = tmp_path / "cfg.yaml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        return path

    return make


def errors_of(out) -> list[str]:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return [line.strip() for line in out.stderr.splitlines() if line.startswith("  ")]


def test_the_good_config_passes(project, tmp_path):
    out = rl_cli("run", project(), "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "data OK" in out.stdout and "config OK" in out.stdout


MISTAKES = {
    "label key": (dict(data={"label_key": "answer"}),
                  "data.label_key: no key 'answer' in the first 5 rows of prompts.jsonl (they have: prompt, label)"),
    "metadata key": (dict(data={"metadata_key": "meta"}), "data.metadata_key: no key 'meta' in the first 5 rows"),
    "no generator": (dict(drop=("generator",)), "generator: required to train; choose one of: multi_turn, openai_agent, single_turn"),
    "no loss": (dict(drop=("loss",)), "loss: required to train"),
    "hub id": (dict(model={"path": "Qwen/Qwen3-0.6B"}),
               "model.path: no such directory: Qwen/Qwen3-0.6B. If it is a Hugging Face hub id, download it first "
               "(`hf download Qwen/Qwen3-0.6B --local-dir checkpoints/Qwen3-0.6B`) and set "
               "model.path: checkpoints/Qwen3-0.6B"),
    "local path, not a hub id": (dict(model={"path": "./ckpts/model"}), "model.path: no such directory: ./ckpts/model"),
    "too few prompts": (dict(rollout={"num_rollouts": 10}),
                        "data.epochs: 5 prompts x 1 epoch(s) = 5, but rollout.num_rollouts (10) x "
                        "rollout.rollout_batch_size (2) needs 20; set data.epochs: 4"),
    "tool name": (dict(generator={"name": "multi_turn", "tools": ["calculater"]}),
                  "generator.tools.0: unknown tool 'calculater'. Did you mean 'calculator'?"),
    "eval keys": (dict(eval={"interval": 1, "datasets": [{"name": "e", "path": "prompts.jsonl",
                                                          "input_key": "question"}]}),
                  "eval.datasets.0.input_key: no key 'question' in the first 5 rows"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_one_line_before_anything_starts(project, tmp_path, mistake):
    changes, expected = MISTAKES[mistake]
    out = rl_cli("run", project(**changes), "--run-dir", tmp_path / "run", cwd=tmp_path)  # a real run, not --dry-run
    errors = [e.replace(f"{tmp_path}/", "") for e in errors_of(out)]
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert not (tmp_path / "run").exists()  # nothing started: the run directory is made after the checks


def test_every_mistake_reported_at_once_with_dry_run(project, tmp_path):
    cfg = project(drop=("generator",), data={"label_key": "answer"}, model={"path": "Qwen/Qwen3-0.6B"},
                  rollout={"num_rollouts": 10}, trainer={"micro_batch_size": 3})
    errors = errors_of(rl_cli("run", cfg, "--dry-run", cwd=tmp_path))
    starts = sorted(e.split(":")[0] for e in errors)
    # the config does not validate: still every check its raw mapping allows
    assert starts == ["data.label_key", "generator", "trainer.micro_batch_size"], errors
    cfg = project(drop=("generator",), data={"label_key": "answer"}, model={"path": "Qwen/Qwen3-0.6B"},
                  rollout={"num_rollouts": 10})
    errors = errors_of(rl_cli("run", cfg, "--dry-run", cwd=tmp_path))
    assert sorted(e.split(":")[0] for e in errors) == ["data.epochs", "data.label_key", "generator", "model.path"]


def test_default_label_key_missing_is_a_note_not_an_error(project, tmp_path):
    (tmp_path / "nolabel.jsonl").write_text('{"prompt": "a"}\n' * 4)
    out = rl_cli("run", project(data={"path": "nolabel.jsonl"}), "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "note: data.label_key: no key 'label'" in out.stderr


def test_model_path_must_be_a_checkpoint_directory(project, tmp_path):
    (tmp_path / "empty").mkdir()
    errors = errors_of(rl_cli("run", project(model={"path": "empty"}), "--dry-run", cwd=tmp_path))
    assert errors == ["model.path: empty is not an HF checkpoint directory (no config.json in it)"]


def test_preview_counts_rows_and_applies_the_slice(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in ROWS))
    seen = preview("p.jsonl@[2:]", tmp_path, n=2)
    assert seen.count == 3 and [r["prompt"] for _, r in seen.rows] == ["2+1=", "3+1="]
    assert seen.rows[0][0].endswith("p.jsonl:5")  # file:line, blank lines counted
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    assert preview(str(tmp_path / "p.json"), n=1).count == 5
