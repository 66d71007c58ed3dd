"""The fsdp2 trainer: the same numbers as Megatron on one checkpoint, DP=2 equal to DP=1, resume across sizes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _torchrun(nproc: int, *args: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(port), str(HERE / "fsdp2_worker.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= rel * max(1.0, abs(b[k])), f"{k}: {a[k]} != {b[k]}"


def _weights_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, f"weights differ by {worst}"


def test_fsdp2_equals_megatron_on_one_checkpoint(tiny_ckpts):
    """Loaded from one HF checkpoint, the fsdp2 and megatron backends give the same log-probs, entropy and
    first step (loss, grad norm, KL, entropy), and the same log-probs after it (at a sampling temperature of 0.7)."""
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import contract_batch, run_config

    plugins = load_plugins(autoload=False)
    results = {}
    for name in ("fsdp2", "megatron"):
        cls = plugins.registry("trainers")[name]
        backend = cls(cls.Config())
        run = run_config(backend)
        run.model.config.path = str(tiny_ckpts("qwen3"))
        model = backend.build(run.model.create(plugins), run)
        batch = contract_batch()
        lp, ent = model.log_probs(batch, with_entropy=True)
        batch.old_log_probs, batch.ref_log_probs = lp, lp - 0.01
        metrics = model.train_step(batch, run.loss.create(plugins))
        batch.temperature = 0.7  # the rollout's temperature: both score log_softmax(z / T)
        results[name] = (lp, ent, metrics, model.log_probs(batch)[0])
    (lp, ent, metrics, after), (m_lp, m_ent, m_metrics, m_after) = results["fsdp2"], results["megatron"]
    assert (lp - m_lp).abs().max() < 1e-5 and (ent - m_ent).abs().max() < 1e-5
    _close(metrics, m_metrics, 1e-5)
    assert (after - m_after).abs().max() < 1e-5
    assert (after - lp).abs().max() > 1e-3, "the step moved the weights"


@pytest.mark.slow
def test_dp2_equals_dp1_and_resumes_across_sizes(tiny_ckpts, tmp_path):
    """DP=2 (two gloo ranks, parameters sharded by FSDP2) gives DP=1's log-probs and first step to 1e-5
    relative; a checkpoint written at DP=2 resumes at DP=1 with exactly its weights, and one written at DP=1
    resumes at DP=2, the next step then equal to the run that went on."""
    hf = str(tiny_ckpts("qwen3"))
    _torchrun(2, hf, str(tmp_path / "dp2.pt"), str(tmp_path / "ckpt2"))
    _torchrun(1, hf, str(tmp_path / "dp1.pt"), str(tmp_path / "ckpt1"), str(tmp_path / "ckpt2"))
    _torchrun(2, hf, str(tmp_path / "dp2b.pt"), str(tmp_path / "ckpt2b"), str(tmp_path / "ckpt1"))
    dp2, dp1, dp2b = (torch.load(tmp_path / f, weights_only=False) for f in ("dp2.pt", "dp1.pt", "dp2b.pt"))
    assert (dp2["lp"] - dp1["lp"]).abs().max() < 1e-6 and (dp2["ent"] - dp1["ent"]).abs().max() < 1e-6
    _close(dp2["m1"], dp1["m1"], 1e-5)
    assert (dp2["lp1"] - dp1["lp1"]).abs().max() < 1e-5
    for resumed, writer in ((dp1, dp2), (dp2b, dp1)):  # DP=1 from DP=2's checkpoint, DP=2 from DP=1's
        assert all(torch.equal(resumed["resumed_w1"][k], writer["w1"][k]) for k in writer["w1"]), \
            "the checkpoint's weights come back exactly"
        _close(resumed["resumed_m2"], writer["m2"], 1e-5)
        _weights_close(resumed["resumed_w2"], writer["w2"], 1e-6)


def test_activation_checkpointing_and_micro_batches_change_nothing(tiny_ckpts):
    """Recomputing each layer in backward, or another micro-batch split (by tokens), gives the same step."""
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import contract_batch, run_config

    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    results = []
    for checkpointing, trainer_keys in ((False, {}), (True, {}), (False, {"max_tokens_per_micro_batch": 8})):
        backend = cls(cls.Config(activation_checkpointing=checkpointing))
        run = run_config(backend, **trainer_keys)
        run.model.config.path = str(tiny_ckpts("qwen3"))
        model = backend.build(run.model.create(plugins), run)
        batch = contract_batch()
        batch.old_log_probs, batch.ref_log_probs = (lp := model.log_probs(batch)[0]), lp - 0.01
        results.append((model.train_step(batch, run.loss.create(plugins)), model.log_probs(batch)[0]))
    (base, base_lp), *others = results
    for metrics, lp in others:  # the loss's own metrics are micro-batch means; these four are the batch's
        _close({k: metrics[k] for k in ("loss", "grad_norm", "kl", "entropy")},
               {k: base[k] for k in ("loss", "grad_norm", "kl", "entropy")}, 1e-5)
        assert (lp - base_lp).abs().max() < 1e-5


def test_random_init_scales_the_residual_outputs_as_megatron_does():
    """Without a checkpoint, each block's o_proj and down_proj are transformers' draw times 1 / sqrt(2 L) (Megatron's
    output-layer init; L = 2 here: a factor 1/2), every other tensor transformers' draw as is."""
    from posttrain.core.plugins import load_plugins
    from posttrain.plugins.trainers.fsdp2.model import build_hf_model

    spec = load_plugins(autoload=False).models["qwen3"]()
    plain = dict(build_hf_model(spec, seed=3, scaled_output_init=False).named_parameters())
    scaled = dict(build_hf_model(spec, seed=3).named_parameters())
    changed = sorted(n for n in plain if not torch.equal(plain[n], scaled[n]))
    assert changed == [f"model.layers.{i}.{p}.weight" for i in (0, 1) for p in ("mlp.down_proj", "self_attn.o_proj")]
    assert all(torch.allclose(scaled[n], plain[n] * 0.5) for n in changed)


@pytest.mark.parametrize("overrides, error", [
    ({"model": {"name": "hf"}}, "trainer.backend: model 'hf' has no Megatron mapping; megatron trains deepseek_v3, glm4, "),
    ({"trainer": {"backend": {"name": "fsdp2"}}, "estimator": "gae"},
     "trainer.backend: fsdp2 trains no critic, which estimator 'gae' needs"),
])
def test_backend_mistakes_are_one_line_config_errors(overrides, error):
    from posttrain.core.config import load_config
    from posttrain.core.errors import ConfigError
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import RUN

    data = {**RUN, **{k: v for k, v in overrides.items() if k != "trainer"},
            "trainer": {**RUN["trainer"], **overrides.get("trainer", {})}}
    with pytest.raises(ConfigError) as caught:
        load_config(None, data=data, plugins=load_plugins(autoload=False))
    assert any(e.startswith(error) for e in caught.value.errors), caught.value.errors
