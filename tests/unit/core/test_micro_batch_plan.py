"""``trainer.max_tokens_per_micro_batch: auto`` (core.micro_batch_plan): the plan on H100- and H200-sized devices
for the GPU example's Qwen3-1.7B, against what was measured of it, and its parts on other shapes."""

import pytest

from posttrain.core.config import load_config
from posttrain.core.errors import ConfigError
from posttrain.core.gpu_memory import GIB
from posttrain.core.micro_batch_plan import CPU_TOKENS, MAX_TOKENS, MIB, Shape, plan
from posttrain.core.plugins import load_plugins
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "gpu" / "qwen3-1.7b-grpo.yaml"
H100, H200 = 85_045_231_616, 150_110_011_392  # torch.cuda.mem_get_info()'s total: 79.2 and 139.8 GiB


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def hf_of(plugins, name, preset):
    cfg = load_config(EXAMPLE, [f"model.name={name}", f"model.preset={preset}"], plugins)
    return cfg.model.create(plugins).hf_config()


def shape_of(plugins, preset):
    return Shape.from_hf(hf_of(plugins, "qwen3", preset))


def example_plan(plugins, total, colocate=True):
    cfg = load_config(EXAMPLE, plugins=plugins)
    assert cfg.trainer.max_tokens_per_micro_batch == "auto"  # the example asks for the plan
    return plan(shape_of(plugins, "qwen3-1.7B"), total_bytes=total, device="gpu", colocated=colocate,
                sample_tokens=cfg.rollout.max_new_tokens, logits_chunk=4096)


def test_the_1_7b_shape_and_its_state_match_what_was_measured(plugins):
    shape = shape_of(plugins, "qwen3-1.7B")
    assert shape.params == pytest.approx(1.72e9, rel=0.01)  # Qwen3-1.7B, embeddings tied
    assert (shape.layers, shape.hidden, shape.q_width, shape.kv_width, shape.mlp_width) == (28, 2048, 2048, 1024, 6144)
    p = example_plan(plugins, H200)
    assert p.state / GIB == pytest.approx(28.84, rel=0.01)  # the offloaded state of the colocated run
    # trainer allocator peak 76.5 GiB at 16,384 tokens (H200): (76.5 - state - logits) / 16,384 = 2.54 MiB
    assert p.per_token / MIB == pytest.approx((76.5 * GIB - p.state - p.fixed) / 16384 / MIB, rel=0.05)


def test_the_gpu_example_gets_8192_tokens_on_an_h100_and_16384_on_an_h200(plugins):
    h100, h200 = example_plan(plugins, H100), example_plan(plugins, H200)
    assert (h100.tokens, h200.tokens) == (8192, 16384)  # 16,384 ran out of memory on the H100
    assert h100.state + h100.fixed + h100.engines + 1.25 * h100.tokens * h100.per_token < H100
    assert example_plan(plugins, H100, colocate=False).tokens == 12288  # the engine on a GPU of its own
    line = h100.line()
    assert line.startswith("trainer.max_tokens_per_micro_batch: auto -> 8192 (gpu, 79.2 GiB: model state 28.8 GiB")


def test_what_else_the_plan_counts(plugins):
    shape = shape_of(plugins, "qwen3-1.7B")
    base = plan(shape, total_bytes=H100, device="gpu", sample_tokens=600, logits_chunk=4096)
    assert plan(shape, total_bytes=H100, device="gpu", sample_tokens=600, logits_chunk=4096, reference=True).state \
        == base.state + 2 * shape.params
    assert plan(shape, total_bytes=H100, device="gpu", sample_tokens=600, critic=True, logits_chunk=4096).tokens \
        < base.tokens
    unchunked = plan(shape, total_bytes=H100, device="gpu", sample_tokens=600)
    assert unchunked.fixed == 0 and unchunked.per_token == base.per_token + 12 * shape.vocab
    assert plan(shape, total_bytes=H200 * 4, device="gpu", sample_tokens=600).tokens == MAX_TOKENS
    # a model whose state alone fills the device: one sample a pass (the run's OOM line then names the key)
    assert plan(shape, total_bytes=20 * GIB, device="gpu", sample_tokens=600).tokens == 600
    cpu = plan(shape, total_bytes=None, device="cpu", sample_tokens=600)
    assert cpu.tokens == CPU_TOKENS and cpu.line() == f"trainer.max_tokens_per_micro_batch: auto -> {CPU_TOKENS} (on cpu)"


def test_a_mixture_of_experts_plans_its_active_experts(plugins):
    hf = hf_of(plugins, "qwen3_moe", "qwen3-30B-A3B")
    shape = Shape.from_hf(hf)
    assert shape.mlp_width == hf["num_experts_per_tok"] * hf["moe_intermediate_size"]
    assert shape.params == pytest.approx(30.5e9, rel=0.03)  # Qwen3-30B-A3B
    assert plan(shape, total_bytes=H200, device="gpu", sample_tokens=600).tokens == 600  # 30B's state: 500+ GiB


def test_auto_is_a_value_of_the_key_and_other_words_are_one_line(plugins):
    cfg = load_config(EXAMPLE, ["trainer.max_tokens_per_micro_batch=4096"], plugins)
    assert cfg.trainer.max_tokens_per_micro_batch == 4096
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, ["trainer.max_tokens_per_micro_batch=autp"], plugins)
    assert any("trainer.max_tokens_per_micro_batch" in e and "auto" in e for e in err.value.errors), err.value.errors


def test_the_trainer_resolves_auto_before_it_builds_and_says_so(plugins):
    from posttrain.core.actors.trainer import TrainerRole

    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["trainer.max_tokens_per_micro_batch=auto"], plugins)
    trainer = TrainerRole(cfg.to_dict())
    try:
        assert trainer.cfg.trainer.max_tokens_per_micro_batch == CPU_TOKENS
        assert trainer.micro_batch_plan() == f"trainer.max_tokens_per_micro_batch: auto -> {CPU_TOKENS} (on cpu)"
    finally:
        trainer.close()
