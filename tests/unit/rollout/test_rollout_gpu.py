"""GPU paths of the local engine (bf16, CUDA-graph decode): run only where CUDA is present."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_engine_logprobs_match_a_bf16_forward(tiny_ckpt):
    import threading

    from transformers import AutoModelForCausalLM

    from posttrain.plugins.engines.local.engine import LocalEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner
    from posttrain.plugins.engines.local.sampling import parse_sampling

    runner = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=256, cuda_graphs=True)
    engine = LocalEngine(runner, None, [0])
    done, box = threading.Event(), {}
    engine.submit([5, 6, 7, 8], parse_sampling({"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True,
                                                "sampling_seed": 1}), True, lambda o: (box.update(o), done.set()))
    assert done.wait(60)
    engine.shutdown()
    ids = box["output_ids"]
    lps = torch.tensor([x[0] for x in box["meta_info"]["output_token_logprobs"]])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8] + ids], device="cuda")).logits[0, 3:-1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids, device="cuda")[:, None]).squeeze(1).cpu()
    assert torch.allclose(lps, ref, atol=5e-2)  # bf16: same model, different kernels
