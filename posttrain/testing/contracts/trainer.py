"""The trainer-backend contract: the model a backend builds keeps the interface the loop relies on.

Subclass :class:`TrainerContract` and supply a ``trainer_backend`` fixture (an instance, configured to run
here). The contract builds the backend's models on the tiny Qwen3 preset (float32, random init) with a
small run config (``kl_loss_coef`` and ``entropy_coef`` on, an lr warm-up, so the lr depends on the step)
and a fixed batch of 4 samples of different lengths, and checks (``[B, T]`` as in
:class:`~posttrain.core.train_batch.TrainBatch`):

- ``log_probs``: float32 ``[B, T]`` on the CPU, finite, ``<= 0``, exactly 0 at column 0 and past each
  sample's length; entropy ``[B, T]`` in ``[0, log V]``; equal (to ``1e-4``) to HF ``transformers``'
  ``log_softmax(z[t - 1])[tokens[t]]`` on the backend's own ``save_hf`` checkpoint;
- the reference (``weights="ref"``) equals the policy exactly before a step and stays put after one;
- ``train_step``: ``loss``, ``grad_norm``, ``lr`` (``== lr_at(step)``) and ``pg/...`` metrics, finite;
  the weights move; micro-batch size changes neither the loss nor the gradient norm;
- ``save``/``load``: a fresh model that loads a checkpoint has the same weights, reference and optimizer
  state (the next step gives the same metrics and weights);
- ``offload``/``onload`` (backends with ``offloads = True``): a model offloaded and brought back between two
  steps ends them exactly where a model that stayed ends them (other backends: a run that asks them to
  offload is refused at validation);
- ``export_hf``: exactly the HF checkpoint's tensor names and shapes, in buckets of at most
  ``bucket_bytes``; ``save_hf`` writes the same tensors with a ``config.json`` transformers loads;
- ``role="critic"`` (skipped for a backend whose ``build`` raises ``NotImplementedError`` for it):
  ``values`` ``[B, T]``, 0 outside the valid columns, and a value step changes them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest

from posttrain.testing.contracts.common import ComponentContract

RUN = {
    "model": {"name": "qwen3", "preset": "tiny", "dtype": "float32", "tokenizer": "char"},
    "estimator": "grpo", "loss": "ppo_clip", "generator": "single_turn", "rewards": [{"name": "exact_match"}],
    "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 8},
    "trainer": {"global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "lr_warmup_steps": 4, "grad_clip": 1.0,
                "kl_loss_coef": 0.1, "entropy_coef": 0.01},
}
PROMPT_LENGTHS, RESPONSE_LENGTHS = [3, 4, 2, 5], [4, 2, 5, 3]


@functools.cache
def builtins() -> Any:
    """posttrain's own plugins (the contract's run config names only built-ins: qwen3, grpo, ppo_clip)."""
    from posttrain.core.plugins import load_plugins

    return load_plugins(autoload=False)


def run_config(backend: Any, **trainer: Any) -> Any:
    """The contract's RunConfig with ``backend`` as ``trainer.backend`` (``trainer`` keys override)."""
    from posttrain.core.config import load_config
    from posttrain.core.selection import Selection

    data = {**RUN, "trainer": {**RUN["trainer"], **trainer}}
    run = load_config(None, data=data, plugins=builtins())
    run.trainer.backend = Selection("trainers", backend.name, backend.config, cls=type(backend))
    return run


def contract_batch() -> Any:
    """4 samples (prompt + response lengths 7, 6, 7, 8), tokens in [1, 100), advantages +-1."""
    import torch

    from posttrain.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 100, (p + r,), generator=g).tolist() for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    batch = TrainBatch.from_lists(tokens, PROMPT_LENGTHS)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch.response_mask
    batch.returns = torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None] * batch.response_mask
    return batch


def valid_columns(batch: Any) -> Any:
    """``[B, T]`` bool: columns ``1 <= t < lengths[b]`` (a token with a prefix)."""
    import torch

    cols = torch.arange(batch.tokens.shape[1])[None]
    return (cols >= 1) & (cols < batch.lengths[:, None])


def hf_weights(model: Any) -> dict[str, Any]:
    return {name: t.detach().float().cpu().clone() for bucket in model.export_hf(1 << 30) for name, t in bucket}


class TrainerContract(ComponentContract):
    """Supply a ``trainer_backend`` fixture (an instance of the backend, configured to run here)."""

    @pytest.fixture
    def component(self, trainer_backend):
        return trainer_backend

    @pytest.fixture
    def run(self, trainer_backend):
        return run_config(trainer_backend)

    @pytest.fixture
    def spec(self, run):
        return run.model.create(builtins())

    @pytest.fixture
    def loss_fn(self, run):
        return run.loss.create(builtins())

    @pytest.fixture
    def policy(self, trainer_backend, spec, run):
        return trainer_backend.build(spec, run, role="actor", seed=0)

    @pytest.fixture
    def batch(self, policy):
        """The contract batch with ``old_log_probs`` and ``ref_log_probs`` from ``policy``."""
        batch = contract_batch()
        batch.old_log_probs = policy.log_probs(batch)[0]
        batch.ref_log_probs = policy.log_probs(batch, weights="ref")[0]
        return batch

    def test_memory_keys_are_keys_of_its_run_config(self, trainer_backend, run):
        """``memory_keys``, named with their values when a pass runs out of GPU memory, exist in the run config."""
        from posttrain.core.out_of_memory import config_value

        config = run.to_dict()
        missing = [key for key in type(trainer_backend).memory_keys if config_value(config, key) is None]
        assert not missing, f"{trainer_backend.name}.memory_keys not in its run config: {missing}"

    # ------------------------------------------------------------------ forward
    def test_log_probs_shape_masking_and_range(self, policy, batch, spec):
        import torch

        lp, ent = policy.log_probs(batch, with_entropy=True)
        shape = tuple(batch.tokens.shape)
        assert tuple(lp.shape) == shape and tuple(ent.shape) == shape, f"log_probs {tuple(lp.shape)}, expected {shape}"
        assert lp.dtype == torch.float32 and lp.device.type == "cpu", "float32 CPU tensors come back"
        valid = valid_columns(batch)
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
        assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all(), "0 at column 0 and past each length"
        assert (lp[valid] <= 0).all() and (lp[valid] < 0).any()
        vocab = int(spec.hf_config()["vocab_size"])  # padded vocabulary rows carry no probability
        assert (ent[valid] >= -1e-5).all() and (ent[valid] <= math.log(vocab) + 1e-4).all(), "entropy in [0, log V]"
        assert policy.log_probs(batch)[1] is None, "no entropy unless asked"

    def test_log_probs_equal_transformers_on_its_hf_checkpoint(self, policy, batch, tmp_path):
        import torch
        from transformers import AutoModelForCausalLM

        policy.save_hf(tmp_path / "hf")
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(hf(batch.tokens).logits.float(), -1)
        expected = torch.zeros_like(batch.old_log_probs)
        expected[:, 1:] = logp[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        valid = valid_columns(batch)
        diff = (policy.log_probs(batch)[0] - expected)[valid].abs().max()
        assert diff < 1e-4, f"log_probs[b, t] = log_softmax(z[b, t-1])[tokens[b, t]]: off by {float(diff):.2e}"

    def test_reference_equals_policy_before_a_step(self, policy, batch):
        import torch

        assert torch.equal(batch.old_log_probs, batch.ref_log_probs), "weights='ref' is the initial policy"

    # ------------------------------------------------------------------ training
    def test_train_step_moves_the_weights_not_the_reference(self, policy, batch, loss_fn, run):
        import torch

        from posttrain.core.trainer_backend import lr_at

        before = hf_weights(policy)
        metrics = policy.train_step(batch, loss_fn)
        for key in ("loss", "grad_norm", "lr"):
            assert key in metrics and math.isfinite(metrics[key]), f"train_step metrics need a finite {key!r}"
        assert any(k.startswith("pg/") for k in metrics), "the loss's own metrics come back prefixed pg/"
        assert metrics["lr"] == pytest.approx(lr_at(0, run.trainer)), "the lr follows lr_at(step)"
        assert metrics["grad_norm"] > 0
        after = hf_weights(policy)
        assert any(not torch.equal(before[n], after[n]) for n in before), "an optimizer step moves the weights"
        assert torch.equal(policy.log_probs(batch, weights="ref")[0], batch.ref_log_probs), "the reference stays put"
        assert not torch.equal(policy.log_probs(batch)[0], batch.old_log_probs)

    def test_micro_batch_size_changes_nothing(self, trainer_backend, spec, batch, loss_fn, policy):
        whole = trainer_backend.build(spec, run_config(trainer_backend, micro_batch_size=4), role="actor", seed=0)
        split = policy.train_step(batch, loss_fn)
        full = whole.train_step(batch, loss_fn)
        for key in ("loss", "grad_norm"):
            assert split[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), \
                f"{key}: micro-batches of 2 give {split[key]}, one of 4 gives {full[key]}"

    def test_save_load_round_trip_is_exact(self, trainer_backend, spec, run, policy, batch, loss_fn, tmp_path):
        import torch

        policy.train_step(batch, loss_fn)
        policy.save(tmp_path / "ckpt")
        fresh = trainer_backend.build(spec, run, role="actor", seed=0)
        fresh.load(tmp_path / "ckpt")
        saved, loaded = hf_weights(policy), hf_weights(fresh)
        assert all(torch.equal(saved[n], loaded[n]) for n in saved), "load restores the weights exactly"
        assert torch.equal(fresh.log_probs(batch, weights="ref")[0], batch.ref_log_probs), "and the reference"
        a, b = policy.train_step(batch, loss_fn), fresh.train_step(batch, loss_fn)
        assert a["lr"] == b["lr"], "the step counter (lr schedule) is restored"
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        after_a, after_b = hf_weights(policy), hf_weights(fresh)
        worst = max(float((after_a[n] - after_b[n]).abs().max()) for n in after_a)
        assert worst < 1e-6, f"the optimizer state is restored: the next step differs by {worst:.2e}"

    def test_offload_round_trip_changes_nothing(self, trainer_backend, spec, run, policy, batch, loss_fn):
        import torch

        if not getattr(type(trainer_backend), "offloads", False):  # then the loop never asks it to
            run.resources.colocate = run.resources.offload_trainer = True
            assert any(e.startswith(f"resources.offload_trainer: trainer backend {trainer_backend.name!r}")
                       for e in run.validate()), "a run asking it to offload is refused before anything starts"
            return
        stayed = trainer_backend.build(spec, run, role="actor", seed=0)
        for model in (policy, stayed):
            model.train_step(batch, loss_fn)
        assert policy.offload() > 0, "offload() returns the bytes it freed on the device"
        policy.onload()
        a, b = policy.train_step(batch, loss_fn), stayed.train_step(batch, loss_fn)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], "the step after the round trip is the same"
        after, want = hf_weights(policy), hf_weights(stayed)
        assert all(torch.equal(after[n], want[n]) for n in want), "weights and optimizer state came back exactly"
        assert torch.equal(policy.log_probs(batch, weights="ref")[0], stayed.log_probs(batch, weights="ref")[0])

    # ------------------------------------------------------------------ weights out
    def test_export_hf_covers_the_hf_checkpoint(self, policy, spec, tmp_path):
        import json

        import torch
        import transformers
        from safetensors.torch import load_file

        hf = spec.hf_config()
        config = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k not in (
            "model_type", "architectures", "torch_dtype")})
        reference = transformers.AutoModelForCausalLM.from_config(config).state_dict()
        if hf.get("tie_word_embeddings"):
            reference.pop("lm_head.weight", None)
        bucket_bytes = 64 << 10
        buckets = list(policy.export_hf(bucket_bytes))
        names = [n for b in buckets for n, _ in b]
        assert sorted(names) == sorted(reference), \
            f"export_hf names != HF's: missing {sorted(set(reference) - set(names))[:3]}, extra {sorted(set(names) - set(reference))[:3]}"
        assert len(names) == len(set(names)), "every tensor once"
        exported = {n: t for b in buckets for n, t in b}
        for name, t in exported.items():
            assert tuple(t.shape) == tuple(reference[name].shape), f"{name}: shape {tuple(t.shape)}"
        assert len(buckets) > 1 and all(len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= bucket_bytes
                                        for b in buckets), "buckets hold at most bucket_bytes (a larger tensor alone)"
        out = tmp_path / "hf"
        policy.save_hf(out)
        written = {}
        for f in sorted(out.glob("*.safetensors")):
            written.update(load_file(str(f)))
        assert sorted(written) == sorted(exported), "save_hf writes the tensors export_hf yields"
        assert all(torch.equal(written[n], exported[n].cpu()) for n in written)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg.get("model_type") == hf["model_type"] and cfg.get("architectures"), "config.json names the model"

    def test_critic_values(self, trainer_backend, spec, run):
        import torch

        try:
            critic = trainer_backend.build(spec, run, role="critic", seed=0)
        except NotImplementedError as exc:  # then runs with critic estimators (gae) fail at start
            pytest.skip(f"{trainer_backend.name} builds no critic: {exc}")
        batch = contract_batch()
        values = critic.values(batch)
        assert tuple(values.shape) == tuple(batch.tokens.shape) and torch.isfinite(values).all()
        assert (values[~valid_columns(batch)] == 0).all(), "values are aligned like log-probs: 0 outside"
        batch.old_values = values
        metrics = critic.train_step(batch)
        assert math.isfinite(metrics["loss"]) and metrics["loss"] > 0
        assert not torch.equal(critic.values(batch), values), "a value step moves the values"

