"""GPU paths of the local engine (bf16, CUDA-graph decode): run only where CUDA is present."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_engine_logprobs_match_a_bf16_forward(tiny_ckpt):
    import threading

    from transformers import AutoModelForCausalLM

    from posttrain.plugins.engines.local.engine import BatchEngine
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
    from posttrain.plugins.engines.local.sampling import parse_sampling

    runner = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=256, tuning=RunnerTuning(cuda_graphs=True))
    engine = BatchEngine(runner, None, [0])
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


def test_stable_memory_gives_memory_back_and_keeps_the_cuda_graphs(tiny_ckpt):
    """Colocated release/resume with weights and KV cache in VMM buffers: the physical memory goes back
    to the device, the same addresses come back, and the graphs captured before the release replay to
    the same logits after it (no recapture)."""
    from posttrain.plugins.engines.local.memory import EngineMemory
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

    # 256 slots x 2048 positions: 64 MiB each for K and V, large enough to see in mem_get_info
    r = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=256, context_length=2048, tuning=RunnerTuning(cuda_graphs=True))
    mem = EngineMemory(r)
    assert mem.make_stable() is None, "CUDA VMM refused here"

    def step():
        r.prefill([0, 1, 2], [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
        return r.decode(torch.tensor([3, 4, 5], device="cuda"), torch.tensor([3, 2, 4], device="cuda"), 4).clone()

    before = step()
    graphs = dict(r._graphs)
    assert graphs
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    mem.release({"weights", "kv_cache"})
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed >= 2 * r.hf_config.num_hidden_layers * 256 * 2048 * r.num_kv_heads * r.head_dim * 2, freed
    mem.resume({"weights", "kv_cache"})
    after = step()
    assert r._graphs.keys() == graphs.keys() and all(r._graphs[k] is graphs[k] for k in graphs)  # not recaptured
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_overlapped_engine_answers_like_the_synchronous_one_on_cuda(tiny_ckpt):
    """Overlap on a GPU (graphs, the Triton attention where it imports, async copies through pinned
    memory): greedy and seeded rows, stop tokens, a context end and more requests than slots give the
    synchronous engine's tokens."""
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning
    from tests.unit.plugins.engines.local.test_overlap import answers, generate, mixed_requests

    runner = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=3, context_length=24, tuning=RunnerTuning(cuda_graphs=True, decode_attention="auto"))
    requests = mixed_requests(runner.vocab_size)
    sync, _ = generate(runner, requests, overlap=False)
    over, stats = generate(runner, requests, overlap=True)
    assert answers(over) == answers(sync)
    assert stats["decode_steps"] > 0
    # a fresh runner: the overlapped engine captures its graphs itself, mid-run, with a step in flight (a capture's
    # warm-up must leave that step's tokens, positions and cache as they were)
    fresh = ModelRunner(tiny_ckpt, device="cuda", dtype="float32", max_slots=3, context_length=24, tuning=RunnerTuning(cuda_graphs=True, decode_attention="auto"))
    over, stats = generate(fresh, requests, overlap=True)
    assert answers(over) == answers(sync)
    assert stats["position_copies"] <= stats["decode_steps"]


def test_fused_projections_on_cuda_match_the_modules_one_by_one(tiny_ckpt):
    from posttrain.plugins.engines.local.model_runner import ModelRunner, RunnerTuning

    out = {}
    for fuse in (False, True):
        r = ModelRunner(tiny_ckpt, device="cuda", dtype="bfloat16", max_slots=4, context_length=300, tuning=RunnerTuning(cuda_graphs=True, fuse_projections=fuse))
        assert (r.fused_groups > 0) == fuse
        logits = r.prefill([0, 1], [[5, 6, 7, 8] * 8, [9, 10] * 5])
        steps = [r.decode(torch.tensor([20, 21], device="cuda"), torch.tensor([32 + s, 10 + s], device="cuda"),
                          max_position=32 + s).clone() for s in range(3)]
        out[fuse] = [torch.log_softmax(x.float(), -1) for x in [logits, *steps]]
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)  # bf16: one matmul or three round differently
