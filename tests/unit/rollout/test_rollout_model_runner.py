"""The slot-cache forward passes against HF's own forward: batched prefill, decode with idle slots,
and the full-span decode that CUDA graphs capture (run eagerly here on CPU)."""

from __future__ import annotations

import pytest
import torch

from posttrain.plugins.engines.local.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_ckpt):
    torch.set_num_threads(1)
    return ModelRunner(tiny_ckpt, max_slots=4, context_length=64)


def hf_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "glm4"])
def test_prefill_and_decode_match_hf_for_each_family(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.testing.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / family, family=family, seed=2)
    r = ModelRunner(ckpt, max_slots=4, context_length=64)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    prompts = {0: [5, 6, 7, 8, 9], 2: [10, 11]}  # slot 1 stays idle: a hole below the highest busy slot
    logits = r.prefill(list(prompts), list(prompts.values()))
    for row, (slot, p) in enumerate(prompts.items()):
        torch.testing.assert_close(logits[row], hf_next_logits(hf, p), atol=1e-4, rtol=1e-4)
    seqs = {s: p + [int(logits[i].argmax())] for i, (s, p) in enumerate(prompts.items())}
    for _ in range(3):
        tokens = torch.tensor([seqs[0][-1], 0, seqs[2][-1]])
        positions = torch.tensor([len(seqs[0]) - 1, 0, len(seqs[2]) - 1])
        out = r.decode(tokens, positions)
        for slot in (0, 2):
            torch.testing.assert_close(out[slot], hf_next_logits(hf, seqs[slot]), atol=1e-4, rtol=1e-4)
            seqs[slot].append(int(out[slot].argmax()))


def test_full_span_decode_equals_the_tight_span(runner):
    """CUDA graphs attend over a fixed span; stale cache entries past each position must not matter."""
    runner.k_cache.normal_()  # garbage everywhere, as after earlier requests
    runner.v_cache.normal_()
    runner.prefill([0, 1], [[5, 6, 7], [8, 9, 10, 11, 12]])
    tokens, positions = torch.tensor([20, 21]), torch.tensor([3, 5])
    tight = runner._decode_eager(tokens, positions, span=6)
    runner.prefill([0, 1], [[5, 6, 7], [8, 9, 10, 11, 12]])  # same state again (decode wrote position 3/5)
    full = runner._decode_eager(tokens, positions, span=runner.context_length)
    torch.testing.assert_close(tight, full, atol=1e-5, rtol=1e-5)


def test_load_weights_rejects_wrong_shapes_and_reports_unknown_names(runner):
    name, tensor = next(iter(runner.model.state_dict().items()))
    assert runner.load_weights({"no.such.weight": torch.zeros(1), name: tensor.clone()}) == ["no.such.weight"]
    with pytest.raises(ValueError, match="does not match"):
        runner.load_weights({name: torch.zeros(3, 3, 3)})
