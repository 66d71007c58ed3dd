"""The local engine in exact mode: a request's logits and reported log-probs are the same bits whatever else
is in the batch, and the decode over the KV cache equals a prefill of the whole sequence (the arithmetic the
trainer's causal pass shares; tests/integration/test_exact_runs.py checks the trainer side end to end)."""

from __future__ import annotations

import pytest
import torch

from posttrain.core import exact
from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning


@pytest.fixture(autouse=True)
def _process_not_left_exact():
    yield
    exact.enable(False)  # adopt() marks the process exact (the sampler's log-softmax); other tests run plain


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_decode_is_batch_invariant_and_equals_the_prefill(family, tmp_path):
    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / family, family=family, seed=3)
    r = ModelRunner(ckpt, max_slots=4, context_length=64, tuning=RunnerTuning(exact=True, compile=True))
    assert r.exact and not r.compile  # exact mode runs eagerly
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    first = r.prefill([0, 1, 2], prompts)
    alone = r.prefill([3], prompts[1:2])
    assert torch.equal(first[1:2], alone)  # a prompt's logits do not depend on the prompts beside it
    seqs = [p + [int(first[i].argmax())] for i, p in enumerate(prompts)]
    for _ in range(3):
        tokens = torch.tensor([s[-1] for s in seqs])
        positions = torch.tensor([len(s) - 1 for s in seqs])
        out = r.decode(tokens, positions)
        one = r.decode(tokens[:1], positions[:1])  # slot 0 again, alone: rewrites the same key and value
        assert torch.equal(out[:1], one)
        for i, s in enumerate(seqs):
            s.append(int(out[i].argmax()))
    # the decode's last logits equal a prefill of the whole sequence (slot 3: the cache's other rows)
    again = r.prefill([3], [seqs[2][:-1]])
    assert torch.equal(again[0], out[2])
    if family.endswith("_moe"):
        assert r.routed_experts is not None


def test_the_sampler_reports_exact_log_softmax_in_an_exact_engine():
    from posttrain.plugins.engines.local.sampling import RequestSampling, sample_tokens

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    exact.enable()
    sampled, lp = sample_tokens(logits, [RequestSampling(temperature=1.0, sampling_seed=i) for i in range(3)], [0, 0, 0])
    tokens, greedy = sample_tokens(logits, [RequestSampling(temperature=0.0)] * 3)
    want = exact.log_softmax(logits)
    assert torch.equal(greedy, want.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(lp, want.gather(1, sampled[:, None])[:, 0])


def test_exact_moe_is_hfs_glm_block_and_refuses_a_router_it_would_misweigh():
    """GLM-4.5's block (sigmoid scores, expert bias, scaling factor, shared expert) through exact.moe: HF's output to
    float rounding, HF's experts; a router whose weights are not the ones its attributes describe is refused."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    from posttrain.plugins.engines.local.exact_mode import ExactMoE
    from posttrain.testing.tiny import tiny_config

    torch.manual_seed(0)
    block = Glm4MoeMoE(tiny_config("glm4_moe"))
    with torch.no_grad():
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            p.normal_(0, 0.2)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    moe = ExactMoE(block)
    assert (moe.routing.score, moe.routing.scale, moe.routing.fp32) == ("sigmoid", 2.5, True)
    x = torch.randn(2, 7, 64)
    y, ids = moe(x)
    _, _, hf_ids = block.gate(x.reshape(-1, 64))
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(y, block(x), rtol=1e-5, atol=1e-5)
    y1, _ = moe(x[1:, 2:5])
    assert torch.equal(y1[0], y[1, 2:5])  # a token's output does not depend on the tokens beside it
    own = block.gate.forward
    block.gate.forward = lambda h: (lambda out: (out[0], out[1] / 2.5, out[2]))(own(h))  # no scaling factor applied
    with pytest.raises(ValueError, match="the router of Glm4MoeMoE weighs its experts otherwise"):
        ExactMoE(block)
