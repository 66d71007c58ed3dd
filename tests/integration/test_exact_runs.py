"""rollout.exact end to end through `rl-cli run` on the CPU (Megatron trainer, local engine): five steps of the
quickstart, 16 new tokens per sample, every response token's train log-prob equal to the rollout's
(``train_rollout_logprob_abs_diff_max`` exactly 0.0 at every step) for qwen3, llama3, a qwen3_moe with
routing replay (llama3 with packed micro-batches) and a glm4_moe with routing replay (sigmoid routing, shared
expert, dense first layer, partial rotary; a smaller batch: 4 samples of 8 tokens); and with TIS on, the first
(only) PPO minibatch's ratio and the TIS weights exactly 1."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
SMALL = ["rollout.exact=true", "rollout.max_new_tokens=16", "rollout.min_new_tokens=16", "rollout.num_rollouts=5",
         "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=8", "checkpoint.interval=0"]
RUNS = {
    "qwen3": ("quickstart.yaml", ["correction=tis"]),
    # packed micro-batches of 4 (THD attention, one exact.attention call per sample)
    "llama3": ("quickstart.yaml", ["model.name=llama3", "model.preset=tiny", "model.tokenizer=char",
                                   "model.dtype=float32", "trainer.backend.sequence_packing=true",
                                   "trainer.micro_batch_size=4"]),
    "qwen3_moe": ("quickstart-moe.yaml", ["rollout.use_router=false"]),
    "glm4_moe": ("quickstart-moe.yaml", ["model.name=glm4_moe", "model.preset=tiny", "model.tokenizer=char",
                                         "model.dtype=float32", "rollout.use_router=false", "rollout.max_new_tokens=8",
                                         "rollout.min_new_tokens=8", "rollout.rollout_batch_size=1",
                                         "trainer.global_batch_size=4", "trainer.micro_batch_size=4"]),
}
SHAPE = {"glm4_moe": (4, 8)}  # samples per step, new tokens per sample (default: 8, 16)


@pytest.mark.parametrize("model", list(RUNS))
def test_five_exact_steps_match_every_token(model, tmp_path):
    config, extra = RUNS[model]
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "run", ROOT / "examples" / config,
                          "--run-dir", run, *SMALL, *extra], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 6))  # steps count from 1
    samples, new = SHAPE.get(model, (8, 16))
    for r in rows:
        assert r["rollout/response_len_mean"] == new
        assert r["train_rollout_logprob_tokens"] == samples * new
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0, r
    assert f"exact: every token matched ({5 * samples * new} tokens, 5 steps)" in out.stdout
    if model == "qwen3":  # TIS: the old log-probs come from their own pass, the ratio from the train pass
        for r in rows:
            assert r["correction/is_weight_mean"] == 1.0 and r["correction/is_clipped_frac"] == 0.0
            assert r["correction/is_ratio_mean"] == 1.0
            assert r["train/pg/ratio_mean"] == 1.0 and r["train/pg/approx_kl"] == 0.0
            assert r["train/pg/clipfrac"] == 0.0
