"""Routing replay (R3): the local engine reports the experts it routed every token to, the sample and the
batch carry them, and the trainer's routers use them, so a router that differs between engine and trainer
no longer inflates the train/rollout log-prob gap."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from posttrain.core import batching
from posttrain.core.rollout.samples import fill
from posttrain.core.types import Sample
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, trainer_configs

PROMPTS = [[5, 6, 7, 8], [20, 21, 22], [9, 10, 11, 12, 13], [40, 41], [50, 51, 52, 53], [60, 61, 62], [7, 8], [3, 4, 5]]


def _checkpoint(src, out, router_noise: float):
    """``src`` with experts that matter (down projections x10: a random-init expert barely moves the
    residual stream) and, with ``router_noise``, every router moved by that much Gaussian noise."""
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(10.0)
            layer.mlp.gate.weight.add_(router_noise * torch.randn(layer.mlp.gate.weight.shape, generator=g))
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def _rollouts(path) -> list[Sample]:
    """Samples of ``PROMPTS`` from the local engine (seeded, temperature 1) with log-probs and routed experts."""
    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner
    from posttrain.plugins.engines.local.sampling import parse_sampling

    engine = BatchEngine(ModelRunner(path, max_slots=8, context_length=64), tokenizer=None, eos_token_ids=[])
    outs: dict[int, dict] = {}
    done = threading.Event()

    def answer(i):
        def cb(out):
            outs[i] = out
            if len(outs) == len(PROMPTS):
                done.set()
        return cb

    try:
        for i, p in enumerate(PROMPTS):
            params = parse_sampling({"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": i})
            engine.submit(p, params, True, answer(i), return_routed_experts=True)
        assert done.wait(120)
    finally:
        engine.shutdown()
    samples = []
    for i, p in enumerate(PROMPTS):
        out = outs[i]
        ids = out["output_ids"]
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        samples.append(fill(Sample(prompt="", index=i, reward=0.0), p, ids, [1] * len(ids), lps, "", "length", 0,
                            last_response=out))
    return samples


@pytest.fixture(scope="module")
def setup(tiny_ckpts, tmp_path_factory, megatron_tp1):
    base = tiny_ckpts("qwen3_moe")
    root = tmp_path_factory.mktemp("r3")
    engine_dir = _checkpoint(base, root / "engine", 0.0)
    samples = _rollouts(engine_dir)
    batch, _, _, rollout = batching.to_batch(samples)
    return engine_dir, _checkpoint(base, root / "perturbed", 0.05), samples, batch, rollout


def _gap(lp, rollout, mask):
    return float(((lp - rollout).abs() * mask).sum() / mask.sum())


def test_samples_and_batch_carry_the_engines_routing(setup):
    _, _, samples, batch, _ = setup
    layers, k = 2, 4
    for s in samples:
        assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, layers * k)
        assert (s.rollout_routed_experts >= 0).all() and (s.rollout_routed_experts < 8).all()
    assert batch.routed_experts.shape == (len(samples), batch.tokens.shape[1], layers * k)
    for i, s in enumerate(samples):  # each sample's last token (never read by the engine) and padding: -1
        assert (batch.routed_experts[i, len(s.tokens) - 1:] == -1).all()


def test_replay_closes_the_train_rollout_gap_of_a_perturbed_router(setup):
    engine_dir, perturbed_dir, _, batch, rollout = setup
    mask = batch.response_mask
    same = MegatronTrainer(spec_for("qwen3_moe", engine_dir), **trainer_configs(
        micro_batch_size=4, global_batch_size=8, routing_replay=True))
    assert _gap(same.log_probs(batch)[0], rollout, mask) < 1e-5  # the engine's own weights, its own routing

    trainer = MegatronTrainer(spec_for("qwen3_moe", perturbed_dir), **trainer_configs(
        lr=1e-3, micro_batch_size=4, global_batch_size=8, routing_replay=True))
    replayed = trainer.log_probs(batch)[0]
    own = trainer.log_probs(replace(batch, routed_experts=None))[0]
    gap_replay, gap_own = _gap(replayed, rollout, mask), _gap(own, rollout, mask)
    assert gap_own > 0.01, gap_own  # the perturbation reroutes tokens
    assert gap_replay < 0.5 * gap_own, (gap_replay, gap_own)

    # the train step routes the same way: against the replayed log-probs as the old policy, its log-probs
    # are equal; with the trainer's own routing they are not
    seen: list[float] = []

    def recording(log_probs, old_log_probs, advantages, response_mask, **kw):
        seen.append(float(((log_probs - old_log_probs).abs() * response_mask).max()))
        return local_loss(log_probs, old_log_probs, advantages, response_mask, **kw)

    batch.old_log_probs, batch.advantages = replayed, mask * 0.1
    trainer.train_step(batch, recording)
    assert max(seen) < 1e-5, seen
    seen.clear()
    fresh = MegatronTrainer(spec_for("qwen3_moe", perturbed_dir), **trainer_configs(
        lr=1e-3, micro_batch_size=4, global_batch_size=8, routing_replay=True))
    fresh.train_step(replace(batch, routed_experts=None), recording)
    assert max(seen) > 0.01, seen
