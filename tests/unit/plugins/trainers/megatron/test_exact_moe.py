"""The Megatron trainer in exact mode against the local engine in exact mode, in one process: the trainer's
log-probs of a batch's tokens equal the engine's prefill log-probs of the same tokens bit for bit (dense qwen3 and
GLM-4; Qwen3-MoE's softmax routing and GLM-4.5's sigmoid routing with a scaling factor, shared expert and dense
first layer: core.exact.moe on both sides, the trainer choosing its experts by the engine's rule without replay;
DeepSeek-V3's latent attention, the engine expanding keys and values from its latent cache as Megatron's MLA does,
and its group-limited routing), and a MoE layer exact mode does not cover is refused by name."""

from __future__ import annotations

import pytest
import torch

from posttrain.core import exact
from tests.unit.plugins.trainers.megatron.train_helpers import spec_for, tp_batch, trainer_configs

pytestmark = pytest.mark.usefixtures("megatron_tp1")


@pytest.fixture(autouse=True)
def _process_not_left_exact():
    yield
    exact.enable(False)


@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in ("qwen3", "glm4", "qwen3_moe", "glm4_moe", "deepseek_v3")]
                         + [("qwen3", "bfloat16"), ("glm4_moe", "bfloat16")])  # bf16: what a GPU run computes in
def test_trainer_log_probs_equal_the_engines_bit_for_bit(tiny_ckpts, family, dtype):
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    path = tiny_ckpts(family)
    trainer = MegatronTrainer(spec_for(family, path, dtype=dtype), exact=True,
                              **trainer_configs(micro_batch_size=2, global_batch_size=4))
    batch = tp_batch()
    lp = trainer.log_probs(batch)[0]
    runner = ModelRunner(path, max_slots=4, context_length=64, tuning=RunnerTuning(exact=True), dtype=dtype)
    seqs = [batch.tokens[i, :n].tolist() for i, n in enumerate(batch.lengths.tolist())]
    _, scored = runner.prefill_scored([0, 1, 2, 3], seqs, [0] * 4)
    for i, n in enumerate(batch.lengths.tolist()):
        assert torch.equal(torch.tensor(scored[i]), lp[i, 1:n]), (i, torch.tensor(scored[i]) - lp[i, 1:n])


def test_a_moe_layer_exact_mode_does_not_cover_is_refused(tiny_ckpts):
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    with pytest.raises(ValueError, match="a gated shared expert, which exact mode does not cover"):
        MegatronTrainer(spec_for("glm4_moe", tiny_ckpts("glm4_moe")), exact=True,
                        **trainer_configs(micro_batch_size=2, global_batch_size=4,
                                          megatron={"moe_shared_expert_gate": True}))
