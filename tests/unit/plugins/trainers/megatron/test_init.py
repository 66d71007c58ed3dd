"""Seeded initialization: the seed alone decides the initial weights (device, TP and PP do not)."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.trainers.megatron import model as M

from tests.unit.plugins.trainers.megatron.test_tp import _torchrun
from tests.unit.plugins.trainers.megatron.train_helpers import seeded_spec, spec_for


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "glm4", "qwen3_moe", "glm4_moe"])
def test_seeded_init_is_megatrons_cpu_init_bit_for_bit(megatron_tp1, family):
    """At TP=1 on the CPU the seeded draw is what Megatron's own CPU initialization made (biases of
    qwen2, the MoE routers of qwen3_moe, glm4_moe's dense first layer beside its MoE layers included), so
    CPU runs keep their weights; on a GPU the same tensors are now used."""
    spec = spec_for(family)
    hf = spec.hf_config()
    torch.manual_seed(5)
    megatron = M.megatron_params(M.build_gpt(spec, hf, init_weights=False,
                                             transformer_overrides={"perform_initialization": True}))
    seeded = M.megatron_params(M.build_gpt(spec, hf, seed=5))
    assert sorted(megatron) == sorted(seeded)
    assert [n for n in megatron if not torch.equal(megatron[n], seeded[n])] == []


def test_seeded_init_depends_on_the_seed_only(megatron_tp1):
    spec = seeded_spec(tied=True)
    hf = spec.hf_config()
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = M.megatron_params(M.build_gpt(spec, hf, seed=1))
    assert torch.equal(torch.rand(3), before)  # the global generator is left where it was
    b = M.megatron_params(M.build_gpt(spec, hf, seed=1))
    c = M.megatron_params(M.build_gpt(spec, hf, seed=2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embedding.word_embeddings.weight"], c["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in a  # tied: the output layer is the embedding
    norms = [n for n in a if n.endswith("layernorm.weight")]
    assert norms and all(bool((a[n] == 1).all()) for n in norms)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["init-tp", "init-pp", "init-pp-tied"])
def test_seeded_init_is_the_same_at_tp2_and_pp2(tmp_path, megatron_tp1, mode):
    """TP=2 shards and PP=2 stages (tied embeddings: the last stage's copy too) gather to the TP=1 weights."""
    from posttrain.core.config import TrainerConfig
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

    _torchrun("-", str(tmp_path / "mp.pt"), "-", mode)
    parallel = torch.load(tmp_path / "mp.pt")
    tied = mode.endswith("-tied")
    trainer = MegatronTrainer(seeded_spec(tied=tied), TrainerConfig(), seed=3)
    full = {k: v for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
    assert sorted(full) == sorted(parallel["params"])
    assert [k for k in full if not torch.equal(full[k], parallel["params"][k])] == []
    if tied:
        embedding = trainer.gpt.embedding.word_embeddings.weight
        assert torch.equal(parallel["last_stage_output"], embedding)


@pytest.mark.slow
def test_seeded_init_is_the_same_at_ep2(tmp_path, megatron_tp1):
    """EP=2 (each rank holds 4 of the 8 experts): the experts gather to the EP=1 weights, for Qwen3-MoE and
    for GLM-4.5's dense-then-MoE layers; not two copies of the first four experts."""
    from posttrain.core.config import TrainerConfig
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from tests.unit.plugins.trainers.megatron.train_helpers import torchrun

    torchrun("moe_worker.py", str(tmp_path / "ep.pt"), "init-ep", timeout=400)
    parallel = torch.load(tmp_path / "ep.pt")
    for family in ("qwen3_moe", "glm4_moe"):
        trainer = MegatronTrainer(spec_for(family), TrainerConfig(), seed=3)
        full = {k: v for bucket in trainer.export_hf(1 << 20) for k, v in bucket}
        assert sorted(full) == sorted(parallel[family])
        assert [k for k in full if not torch.equal(full[k], parallel[family][k])] == [], family
        up = [full[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in (0, 4)]
        assert not torch.equal(*up)


@pytest.mark.slow
def test_seeded_init_is_the_same_at_pp2_when_a_stage_lacks_a_layer_kind(tmp_path, megatron_tp1):
    """GLM-4.5's dense first layer on stage 0 only: stage 1 takes its shapes from a meta-device build of it
    (``layer_module_spec``) and still draws the whole stream, so PP=2 equals one stage."""
    from posttrain.core.config import TrainerConfig
    from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer
    from tests.unit.plugins.trainers.megatron.moe_worker import glm4_moe_4_layers
    from tests.unit.plugins.trainers.megatron.train_helpers import torchrun

    torchrun("moe_worker.py", str(tmp_path / "pp.pt"), "init-pp", timeout=400)
    parallel = torch.load(tmp_path / "pp.pt")
    full = {k: v for bucket in MegatronTrainer(glm4_moe_4_layers(), TrainerConfig(), seed=3).export_hf(1 << 20)
            for k, v in bucket}
    assert sorted(full) == sorted(parallel) and "model.layers.3.mlp.experts.7.down_proj.weight" in full
    assert [k for k in full if not torch.equal(full[k], parallel[k])] == []
