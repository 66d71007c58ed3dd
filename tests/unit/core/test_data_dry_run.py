"""`rl-cli run --dry-run` reports bad dataset rows (file:line) together with config errors."""

import subprocess
import sys


def test_dry_run_reports_three_bad_rows_and_config_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok", "label": "1"}\n{"prompt": \n{"q": "x"}\n{"prompt": 5}\n')
    (tmp_path / "cfg.yaml").write_text(
        "estimator: grpo\nrewards: [math]\ndata: {path: bad.jsonl}\nmodel: qwen3\ngenerator: single_turn\nloss: ppo_clip\n"
        "rollout: {rollout_batch_size: 2, n_samples_per_prompt: 2}\n"
        "trainer: {global_batch_size: 4, micro_batch_size: 3}\n")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", str(tmp_path / "cfg.yaml"), "--dry-run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    text = " ".join(out.stderr.split())  # rich may wrap long lines
    assert "4 error(s)" in text and "Traceback" not in text
    assert "micro_batch_size: 3 does not divide" in text
    assert "bad.jsonl:2: invalid JSON" in text
    assert "bad.jsonl:3: missing key 'prompt'" in text
    assert "bad.jsonl:4: 'prompt' must be a string" in text


def test_dry_run_summarizes_good_data(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "good.jsonl").write_text('{"prompt": "a"}\n{"prompt": 1}\n{"prompt": "c"}\n')
    (tmp_path / "cfg.yaml").write_text(
        "estimator: grpo\ndata: {path: d/good.jsonl, on_bad_row: skip, epochs: 2}\nmodel: qwen3\ngenerator: single_turn\n"
        "loss: ppo_clip\nrollout: {rollout_batch_size: 2, n_samples_per_prompt: 2, num_rollouts: 2}\n"
        "trainer: {global_batch_size: 4, micro_batch_size: 2}\n")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", "cfg.yaml", "--dry-run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "data OK: d/good.jsonl: 2 prompts (1 bad rows skipped" in text and "config OK" in text
