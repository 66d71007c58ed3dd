"""MegatronTrainer on CPU: log-probs, train steps, micro-batching, checkpoints, export, critic."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.config import TrainerConfig
from posttrain.core.errors import UsageError
from posttrain.core.train_batch import TrainBatch
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer, lr_at

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, trainer_configs

pytestmark = pytest.mark.usefixtures("megatron_tp1")


def _batch(seed=0, lengths=(9, 12, 7, 10), prompts=(3, 4, 2, 5)):
    g = torch.Generator().manual_seed(seed)
    lists = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
    batch = TrainBatch.from_lists(lists, list(prompts))
    batch.advantages = torch.randn(len(lists), 1, generator=g) * batch.response_mask
    return lists, batch


def _trainer(tiny_ckpts, **overrides):
    configs = trainer_configs(**{"lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 4, **overrides})
    return MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")), **configs)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.gpt.named_parameters()}


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("packing,temperature", [(True, 1.0), (False, 0.6)])
def test_log_probs_and_entropy_equal_hf(tiny_ckpts, packing, temperature):
    """Log-probs and entropy of ``softmax(z / T)`` at the batch's sampling temperature ``T``, as HF computes them."""
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_ckpts, sequence_packing=packing, attention="sdpa" if packing else "local",
                       log_probs_chunk_size=5)
    lists, batch = _batch()
    batch.temperature = temperature
    lp, ent = trainer.log_probs(batch, with_entropy=True)
    assert lp.shape == ent.shape == batch.tokens.shape
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_ckpts("qwen3")), dtype=torch.float32).eval()
    for i, ids in enumerate(lists):
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float() / temperature, -1)
        expected = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        assert (lp[i, 1: len(ids)] - expected).abs().max() < 1e-5
        assert (ent[i, 1: len(ids)] + (logp.exp() * logp).sum(-1)[:-1]).abs().max() < 1e-5
        assert lp[i, 0] == 0 and lp[i, len(ids):].abs().sum() == 0  # aligned with tokens, 0 off the sample


def test_twenty_steps_on_a_fixed_batch_lower_the_loss(tiny_ckpts):
    trainer = _trainer(tiny_ckpts, lr=3e-3)
    _, batch = _batch()
    batch.advantages = batch.response_mask.clone()  # every sampled token is good: raise its probability
    start = trainer.log_probs(batch)[0]
    batch.old_log_probs = start
    losses = [trainer.train_step(batch, local_loss)["loss"] for _ in range(20)]
    assert losses[-1] < losses[0] - 0.05, losses
    end = trainer.log_probs(batch)[0]
    mask = batch.response_mask.bool()
    assert end[mask].mean() > start[mask].mean() + 0.1


def test_the_train_step_scores_the_sampling_temperature(tiny_ckpts):
    """At ``T = 0.6`` the first step's ratio against log-probs taken at ``T`` is exactly 1, and the log-probs
    are not those at ``T = 1``: the train step and ``log_probs`` scale the logits alike."""
    trainer = _trainer(tiny_ckpts)
    _, batch = _batch(seed=2)
    plain = trainer.log_probs(batch)[0]
    batch.temperature = 0.6
    batch.old_log_probs = trainer.log_probs(batch)[0]
    assert (batch.old_log_probs - plain).abs().max() > 1e-2
    assert batch.select(1, 3).temperature == batch.take([2, 0]).temperature == batch.to("cpu").temperature == 0.6
    metrics = trainer.train_step(batch, local_loss)
    assert abs(metrics["pg/ratio"] - 1.0) < 1e-6


def test_micro_batching_and_packing_do_not_change_the_step(tiny_ckpts):
    _, batch = _batch(seed=3)
    results = []
    for mbs, packing in ((4, True), (1, True), (2, False)):
        trainer = _trainer(tiny_ckpts, micro_batch_size=mbs, sequence_packing=packing,
                           attention="sdpa" if packing else "local")
        batch.old_log_probs = trainer.log_probs(batch)[0]
        metrics = trainer.train_step(batch, local_loss)
        results.append((_params(trainer), metrics["loss"], metrics["grad_norm"]))
    for params, loss, norm in results[1:]:
        assert _max_diff(params, results[0][0]) < 1e-6
        assert abs(loss - results[0][1]) < 1e-6 and norm == pytest.approx(results[0][2], rel=1e-5)


def test_grad_clip_and_kl_and_entropy_terms(tiny_ckpts):
    _, batch = _batch(seed=4)
    trainer = _trainer(tiny_ckpts, grad_clip=1e-3, kl_loss_coef=0.1, entropy_coef=0.01)
    batch.old_log_probs = trainer.log_probs(batch)[0]
    batch.ref_log_probs = trainer.log_probs(batch, weights="ref")[0]
    before = _params(trainer)
    m1 = trainer.train_step(batch, local_loss)
    assert m1["kl"] == pytest.approx(0.0, abs=1e-6) and m1["entropy"] > 0 and m1["grad_norm"] > 1e-3
    m2 = trainer.train_step(batch, local_loss)
    assert m2["kl"] > 0  # the policy moved away from the reference snapshot
    assert _max_diff(_params(trainer), before) > 0
    # the reference snapshot still gives the initial weights' log-probs
    assert torch.equal(trainer.log_probs(batch, weights="ref")[0], batch.ref_log_probs)
    with pytest.raises(UsageError, match="snapshot 'old'"):
        trainer.log_probs(batch, weights="old")


@pytest.mark.parametrize("keys, kept", [({}, False), ({"kl_loss_coef": 0.1}, True), ({"kl_in_reward_coef": 0.1}, True),
                                        ({"log_kl": True}, True)])
def test_the_reference_is_kept_only_for_a_run_that_uses_it(tiny_ckpts, keys, kept):
    """No KL term, no KL reward penalty, no log_kl: the loop never asks for the reference, and the actor keeps no
    copy of the initial weights (a model's worth of device memory at KL 0, slime's default too); asking anyway is
    one clear error."""
    _, batch = _batch(seed=5)
    trainer = _trainer(tiny_ckpts, **keys)
    assert trainer.config.uses_reference is kept
    assert list(trainer._snapshots.saved) == (["ref"] if kept else [])
    if kept:
        assert torch.equal(trainer.log_probs(batch, weights="ref")[0], trainer.log_probs(batch)[0])
    else:
        with pytest.raises(UsageError, match="keeps no reference policy; trainer.kl_loss_coef, kl_in_reward_coef "
                                             "and log_kl are all off"):
            trainer.log_probs(batch, weights="ref")
    assert MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")), role="critic",  # a critic never keeps one
                           **trainer_configs(lr=1e-3, micro_batch_size=2, global_batch_size=4, **keys))._snapshots.saved == {}


def test_lr_schedule():
    cfg = TrainerConfig(lr=1.0, lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=12, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(14)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0
    assert lrs[7] == pytest.approx(0.55) and lrs[12] == pytest.approx(0.1) and lrs[13] == pytest.approx(0.1)
    linear = TrainerConfig(lr=1.0, lr_decay_style="linear", lr_decay_steps=10)
    assert lr_at(5, linear) == pytest.approx(0.5)


def test_save_load_then_step_equals_step_without_round_trip(tiny_ckpts, tmp_path):
    _, batch = _batch(seed=5)
    trainer = _trainer(tiny_ckpts)
    batch.old_log_probs = trainer.log_probs(batch)[0]
    trainer.train_step(batch, local_loss)
    trainer.train_step(batch, local_loss)
    trainer.save(tmp_path / "ckpt")
    at_save = _params(trainer)
    trainer.train_step(batch, local_loss)
    expected = _params(trainer)

    fresh = _trainer(tiny_ckpts)
    fresh.train_step(batch, local_loss)  # different optimizer state and weights before loading
    fresh.load(tmp_path / "ckpt")
    assert fresh.step == 2
    fresh.train_step(batch, local_loss)
    assert _max_diff(_params(fresh), expected) == 0.0

    no_moments = _trainer(tiny_ckpts)  # the same weights without the optimizer state step elsewhere
    with torch.no_grad():
        for n, p in no_moments.gpt.named_parameters():
            p.copy_(at_save[n])
    no_moments.step = 2
    no_moments.train_step(batch, local_loss)
    assert _max_diff(_params(no_moments), expected) > 1e-5
    with pytest.raises(UsageError, match="no such checkpoint"):
        fresh.load(tmp_path / "missing")


def test_a_checkpoint_of_another_model_is_refused(tiny_ckpts, tmp_path):
    """Dist-checkpointing loads whatever subset a model asks for: a 3-layer checkpoint would fill a
    2-layer model silently. The model's every tensor key and global shape are compared first."""
    from posttrain.testing.tiny import make_tiny_checkpoint

    deeper = MegatronTrainer(spec_for("qwen3", make_tiny_checkpoint(tmp_path / "deep", "qwen3", num_hidden_layers=3)),
                             **trainer_configs(lr=1e-3, micro_batch_size=2, global_batch_size=4))
    deeper.save(tmp_path / "ckpt")
    trainer = _trainer(tiny_ckpts)
    before = _params(trainer)
    with pytest.raises(UsageError, match=r"written by another model: model\.decoder\.layers\..* is \(3, .* there "
                                         r"and \(2, .* in this model"):
        trainer.load(tmp_path / "ckpt")
    assert _max_diff(_params(trainer), before) == 0.0


def test_export_hf_buckets_and_save_hf(tiny_ckpts, tmp_path):
    from safetensors.torch import load_file

    trainer = _trainer(tiny_ckpts)
    original = load_file(str(tiny_ckpts("qwen3") / "model.safetensors"))
    buckets = list(trainer.export_hf(bucket_bytes=40_000))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 40_000 or len(bucket) == 1
    exported = dict(kv for bucket in buckets for kv in bucket)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    _, batch = _batch()
    batch.old_log_probs = trainer.log_probs(batch)[0]
    trainer.train_step(batch, local_loss)
    out = trainer.save_hf(tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = batch.tokens[:1, :9]
    with torch.no_grad():
        logp = torch.log_softmax(reloaded(ids).logits[0], -1)
    expected = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert (trainer.log_probs(batch)[0][0, 1:9] - expected).abs().max() < 1e-5


def test_critic_learns_the_returns(tiny_ckpts):
    trainer = MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")),
                              TrainerConfig(lr=1e-2, micro_batch_size=2, global_batch_size=4), role="critic")
    _, batch = _batch(seed=6)
    batch.returns = 0.5 * batch.response_mask
    assert trainer.values(batch).abs().max() == 0  # zero-initialized head
    losses = [trainer.train_step(batch)["value_loss"] for _ in range(15)]
    assert losses[-1] < 0.3 * losses[0], losses
    values = trainer.values(batch)
    assert (values[batch.response_mask.bool()] - 0.5).abs().mean() < 0.2


@pytest.mark.slow
def test_compiled_layers_give_the_same_log_probs(tiny_ckpts):
    _, batch = _batch(seed=7)
    plain = _trainer(tiny_ckpts).log_probs(batch)[0]
    compiled = _trainer(tiny_ckpts, compile=True).log_probs(batch)[0]
    assert (compiled - plain).abs().max() < 1e-5


def test_bf16_parameters_train_through_fp32_masters_and_checkpoint_them(tiny_ckpts, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on GPU Megatron's optimizer keeps the fp32 main parameters")
    spec = spec_for("qwen3", tiny_ckpts("qwen3"), dtype="bfloat16")
    config = TrainerConfig(lr=1e-6, micro_batch_size=2, global_batch_size=4)
    trainer = MegatronTrainer(spec, config)
    _, batch = _batch(seed=8)
    batch.old_log_probs = trainer.log_probs(batch)[0]
    start = [m.detach().clone() for m in trainer._masters]
    trainer.train_step(batch, local_loss)
    moved = max((m - s).abs().max().item() for m, s in zip(trainer._masters, start))
    assert 0 < moved < 1e-5  # an lr-1e-6 Adam step, kept although bf16 cannot represent it
    trainer.save(tmp_path / "ckpt")
    trainer.train_step(batch, local_loss)
    expected = [m.detach().clone() for m in trainer._masters]
    fresh = MegatronTrainer(spec, config)
    fresh.load(tmp_path / "ckpt")
    fresh.train_step(batch, local_loss)
    assert all(torch.equal(a, b) for a, b in zip(fresh._masters, expected))


def test_critic_checkpoint_round_trip(tiny_ckpts, tmp_path):
    config = TrainerConfig(lr=1e-2, micro_batch_size=2, global_batch_size=4)
    spec = spec_for("qwen3", tiny_ckpts("qwen3"))
    critic = MegatronTrainer(spec, config, role="critic")
    _, batch = _batch(seed=9)
    batch.returns = 0.5 * batch.response_mask
    critic.train_step(batch)
    critic.save(tmp_path / "critic")
    critic.train_step(batch)
    expected = critic.values(batch)
    fresh = MegatronTrainer(spec, config, role="critic")
    fresh.load(tmp_path / "critic")
    fresh.train_step(batch)
    assert torch.equal(fresh.values(batch), expected) and expected.abs().max() > 0


def test_use_fused_adam_switches_torch_adamw_inside_an_optimizer_wrapper():
    """Megatron wraps torch's AdamW (``.optimizer``; chained ones in ``.chained_optimizers``); the switch
    reaches it, and the fused kernel (CPU has one too) takes the same step as the default."""
    from types import SimpleNamespace

    from posttrain.plugins.trainers.megatron.optim import use_fused_adam

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = torch.optim.AdamW(params, lr=1e-2)
    plain = torch.optim.AdamW(twins, lr=1e-2)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused), SimpleNamespace(optimizer=None)])
    assert use_fused_adam(chained) == 1 and fused.param_groups[0]["fused"] is True
    assert use_fused_adam(SimpleNamespace(optimizer=torch.optim.SGD(twins, lr=0.1))) == 0  # only AdamW
    for _ in range(3):
        for group in (params, twins):
            for p in group:
                p.grad = p.detach() * 0.5 + 1.0
        fused.step()
        plain.step()
    for a, b in zip(params, twins):
        assert torch.allclose(a, b, atol=1e-6)
