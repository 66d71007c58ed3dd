"""The RL step's speed levers on the CPU (issue 17) change no number: old log-probs taken from the train
step, the reference swapped in without copying the policy, micro-batches by tokens."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.train_batch import TrainBatch
from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer, micro_batch_bounds

from tests.unit.plugins.trainers.megatron.train_helpers import local_loss, spec_for, trainer_configs

pytestmark = pytest.mark.usefixtures("megatron_tp1")

LENGTHS, PROMPTS = (9, 30, 4, 17, 6, 25, 11, 5), (3, 4, 2, 5, 2, 6, 3, 2)  # mixed lengths


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = TrainBatch.from_lists([torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS], list(PROMPTS))
    batch.advantages = torch.randn(len(LENGTHS), 1, generator=g) * batch.response_mask
    return batch


def _trainer(tiny_ckpts, **overrides):
    configs = trainer_configs(**{"lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 8, **overrides})
    return MegatronTrainer(spec_for("qwen3", tiny_ckpts("qwen3")), **configs)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.gpt.named_parameters()}


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("packing", [True, False])
def test_old_log_probs_from_the_train_step_equal_a_separate_pass(tiny_ckpts, packing, monkeypatch):
    kw = dict(sequence_packing=packing, attention="sdpa" if packing else "local", entropy_coef=0.01)
    separate, fused = _trainer(tiny_ckpts, **kw), _trainer(tiny_ckpts, **kw)
    batch = _batch(seed=1)
    lp, ent = separate.log_probs(batch, with_entropy=True)
    batch.old_log_probs = lp
    expected = separate.train_step(batch, local_loss)

    batch.old_log_probs = None
    calls = []
    monkeypatch.setattr(fused, "log_probs", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    metrics, kept_lp, kept_ent = fused.train_step(batch, local_loss, keep_log_probs=True)
    assert calls == [], "no separate log-prob pass"
    on = batch.response_mask > 0  # the train step scores response tokens only; the rest are 0
    assert (kept_lp - lp)[on].abs().max() < 1e-6 and (kept_ent - ent)[on].abs().max() < 1e-6
    assert (kept_lp[~on] == 0).all() and (kept_ent[~on] == 0).all() and (lp[~on] != 0).any()
    assert kept_lp.shape == lp.shape and kept_lp.device.type == "cpu"
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-6)
    assert metrics["entropy"] == pytest.approx(expected["entropy"], abs=1e-6)
    assert _max_diff(_params(fused), _params(separate)) < 1e-6


def test_micro_batch_bounds_by_tokens():
    assert micro_batch_bounds([3, 3, 3, 3, 3], 2) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batch_bounds([3, 3, 3, 3, 3], 2, max_tokens=7) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batch_bounds([3, 3, 3, 3, 3], 2, max_tokens=9) == [(0, 3), (3, 5)]
    assert micro_batch_bounds([10, 2, 2, 2], 1, max_tokens=6) == [(0, 1), (1, 4)], "a long sample stands alone"
    # padded rows cost count x longest: [2, 5] is 10 tokens of padded rows, [2, 5, 1] 15
    assert micro_batch_bounds([2, 5, 1, 1], 1, max_tokens=12, packed=False) == [(0, 2), (2, 4)]
    assert micro_batch_bounds([], 4, max_tokens=8) == []
    bounds = micro_batch_bounds(list(LENGTHS), 2, max_tokens=40)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(LENGTHS)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), "consecutive, covering every sample"


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_by_tokens_give_the_fixed_step(tiny_ckpts, packing):
    kw = dict(sequence_packing=packing, attention="sdpa" if packing else "local", entropy_coef=0.01,
              kl_loss_coef=0.1)
    fixed, dynamic = _trainer(tiny_ckpts, **kw), _trainer(tiny_ckpts, max_tokens_per_micro_batch=40, **kw)
    sizes = [e - s for s, e in micro_batch_bounds(list(LENGTHS), 2, 40, packing)]
    assert len(set(sizes)) > 1, f"the test needs micro-batches of different sizes, got {sizes}"
    batch = _batch(seed=2)
    lp, ent = fixed.log_probs(batch, with_entropy=True)
    dlp, dent = dynamic.log_probs(batch, with_entropy=True)
    assert (lp - dlp).abs().max() < 1e-6 and (ent - dent).abs().max() < 1e-6
    batch.old_log_probs, batch.ref_log_probs = lp, lp - 0.01 * batch.response_mask
    a, b = fixed.train_step(batch, local_loss), dynamic.train_step(batch, local_loss)
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    # gradients, not weights: Adam's first step is lr * sign(g), so float-order noise in a ~0 gradient can
    # move a weight by up to lr either way
    grads = {n: p.grad for n, p in dynamic.gpt.named_parameters()}
    assert max((p.grad - grads[n]).abs().max().item() for n, p in fixed.gpt.named_parameters()) < 1e-6


@pytest.mark.parametrize("mode", ["never", "always"])
def test_reference_pass_copies_no_policy_weights_and_equals_the_initial_policy(tiny_ckpts, mode):
    trainer = _trainer(tiny_ckpts, ref_offload=mode, log_kl=True)
    batch = _batch(seed=3)
    batch.old_log_probs = initial = trainer.log_probs(batch)[0]
    assert trainer._snapshots.on_device == (mode == "never")
    trainer.train_step(batch, local_loss)
    policy = _params(trainer)
    storage = {n: p.data_ptr() for n, p in trainer.gpt.named_parameters()}
    moved = trainer.log_probs(batch)[0]
    assert not torch.equal(moved, initial), "the step moved the policy"
    ref = trainer.log_probs(batch, weights="ref")[0]
    assert torch.equal(ref, initial), "weights='ref' is the initial policy, bit for bit"
    assert {n: p.data_ptr() for n, p in trainer.gpt.named_parameters()} == storage, \
        "the policy's own storage is pointed back at, not a copy of it"
    assert _max_diff(_params(trainer), policy) == 0.0, "the policy's weights are untouched"
    assert torch.equal(trainer.log_probs(batch)[0], moved)
    saved = trainer._snapshots.saved["ref"]
    if mode == "never":  # resident: the pass uses the snapshot's own tensors, no copy
        swapped = trainer._snapshots._on_device("ref")
        assert all(swapped[n] is saved[n] for n in saved)
