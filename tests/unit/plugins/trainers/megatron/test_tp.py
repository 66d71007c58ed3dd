"""TP=2, PP=2 and DP=2 (torchrun, two processes on gloo) equal one process: log-probs, steps, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.core.config import TrainerConfig
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, torchrun, tp_batch

HERE = Path(__file__).parent


def _torchrun(*args: str) -> None:
    torchrun("tp_worker.py", *args, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "tp-kept", "pp", "pp-tied"])
def test_model_parallel_equals_tp1(tiny_ckpts, tmp_path, megatron_tp1, mode):
    """TP=2 (or PP=2: one layer per stage, 1F1B schedule; also with tied embeddings split over the first
    and last stage; also TP=2 keeping the log-prob logits instead of recomputing them) gives TP=1's
    log-probs and train step, and save -> load -> step is exact."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    hf_dir = (make_tiny_checkpoint(tmp_path / "tied", "qwen3", tie_word_embeddings=True) if mode == "pp-tied"
              else tiny_ckpts("qwen3"))
    out = tmp_path / "mp.pt"
    _torchrun(str(hf_dir), str(out), str(tmp_path / "ckpt"), *{"tp": [], "tp-kept": ["kept"]}.get(mode, ["pp"]))
    tp2 = torch.load(out)

    trainer = MegatronTrainer(spec_for("qwen3", hf_dir), TrainerConfig(lr=1e-3, micro_batch_size=2,
                                                                       global_batch_size=4))
    batch = tp_batch()
    lp, ent = trainer.log_probs(batch, with_entropy=True)
    assert (lp - tp2["lp"]).abs().max() < 1e-5 and (ent - tp2["ent"]).abs().max() < 1e-5
    batch.old_log_probs = lp
    metrics = trainer.train_step(batch, local_loss)
    assert metrics["loss"] == pytest.approx(tp2["metrics"]["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(tp2["metrics"]["grad_norm"], rel=1e-4)
    exported = {k: v for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    assert sorted(exported) == sorted(tp2["params"])
    assert max((exported[k] - tp2["params"][k]).abs().max().item() for k in exported) < 1e-5
    assert tp2["reload_same"]


@pytest.mark.slow
def test_data_parallel_step_equals_the_full_batch_step(tiny_ckpts, tmp_path, megatron_tp1):
    """Two DP ranks, each given the whole batch and taking its share (balanced by tokens), compute the same
    log-probs and take the same step as one process (the loss is normalized by the global token count,
    gradients summed over DP, metrics reduced over DP)."""
    hf_dir = tiny_ckpts("qwen3")
    _torchrun(str(hf_dir), str(tmp_path / "dp.pt"), str(tmp_path / "unused"), "dp")
    dp = torch.load(tmp_path / "dp.pt")
    trainer = MegatronTrainer(spec_for("qwen3", hf_dir), TrainerConfig(lr=1e-3, micro_batch_size=1,
                                                                       global_batch_size=4))
    batch = tp_batch()
    batch.old_log_probs = trainer.log_probs(batch)[0]
    assert (dp["lp"] - batch.old_log_probs).abs().max() < 1e-6, "shares' log-probs gathered in sample order"
    metrics = trainer.train_step(batch, local_loss)
    assert dp["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert dp["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    exported = {k: v for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    assert max((exported[k] - dp["params"][k]).abs().max().item() for k in exported) < 1e-5
    # train_step(keep_log_probs=True) under DP: every share's training-forward log-probs, in sample order
    on = batch.response_mask > 0  # the train step scores the response only (0 elsewhere)
    assert (dp["fused_lp"] - dp["lp"])[on].abs().max() < 1e-6 and (dp["fused_lp"][~on] == 0).all()
    assert dp["fused_loss"] == pytest.approx(dp["loss"], abs=1e-6)
    assert dp["fused_grad_norm"] == pytest.approx(dp["grad_norm"], abs=1e-6)
