"""Decode throughput of the local engine against HF ``generate`` on the same model and batch, one JSON line.

    python bench/rollout.py                         # CPU, tiny Qwen3 (2 layers, hidden 64)
    python bench/rollout.py --device cuda --shape qwen3-1.7b --prompts 256 --prompt-len 128 --new-tokens 256

Both sides generate exactly ``new_tokens`` per prompt greedily (EOS ignored) from random prompts of
``prompt_len`` tokens; throughput is ``prompts x new_tokens / wall time`` (prefill included), after one
warm-up round each. The engine runs in-process (the scheduler thread and model runner the HTTP server
uses, without HTTP); ``--cuda-graphs`` (default on CUDA) captures its decode step.

Memory-bandwidth bound (``--bandwidth-gbs``, default 4800 on CUDA for an H200, none on CPU): each
decode step must read every weight once plus the KV cache of every running sequence, so
``bound = prompts / ((weight_bytes + kv_bytes_per_token x prompts x mean_context) / bandwidth)`` with
``mean_context = prompt_len + new_tokens / 2``; ``fraction_of_bound = engine_tok_s / bound``.

Target on one H200, Qwen3-1.7B shape, 256 x 128 prompt tokens, 256 new tokens: >= 25k tok/s (HF
``generate`` measured 8.6k tok/s warm there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time

SHAPES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0),
}


def build_model(shape: str, device: str, dtype):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**SHAPES[shape], rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(engine, prompts, new_tokens: int) -> float:
    from posttrain.core.rollout.sampling import parse_sampling

    params = parse_sampling({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    done = threading.Semaphore(0)
    lengths = []

    def finished(out):
        lengths.append(len(out["output_ids"]))
        done.release()

    start = time.perf_counter()
    for p in prompts:
        engine.submit(p, params, False, finished)
    for _ in prompts:
        done.acquire()
    elapsed = time.perf_counter() - start
    assert all(n == new_tokens for n in lengths), "every request must produce new_tokens tokens"
    return elapsed


def run_hf(model, prompts, new_tokens: int, device: str) -> float:
    import torch

    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cuda-graphs", default=None, action=argparse.BooleanOptionalAction)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the bound (GB/s)")
    ap.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    args = ap.parse_args()

    import torch

    from posttrain.core.rollout.engine import LocalEngine
    from posttrain.core.rollout.model_runner import ModelRunner

    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    dtype = torch.bfloat16 if cuda else torch.float32
    graphs = cuda if args.cuda_graphs is None else args.cuda_graphs
    bandwidth = args.bandwidth_gbs if args.bandwidth_gbs is not None else (4800.0 if cuda else None)
    model = build_model(args.shape, args.device, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    context = args.prompt_len + args.new_tokens + 1

    runner = ModelRunner(None, device=args.device, dtype=str(dtype).removeprefix("torch."), max_slots=args.prompts,
                         context_length=context, cuda_graphs=graphs, model=model)
    engine = LocalEngine(runner, tokenizer=None, eos_token_ids=[])
    run_engine(engine, prompts, min(args.new_tokens, 8))  # warm-up: kernels, allocator, graphs of small buckets
    run_engine(engine, prompts, args.new_tokens)  # warm-up at full size (captures the full-batch graph)
    engine_s = run_engine(engine, prompts, args.new_tokens)
    engine.shutdown()
    total = args.prompts * args.new_tokens
    result = {"bench": "rollout", "device": torch.cuda.get_device_name() if cuda else f"cpu {platform.machine()} "
              f"{torch.get_num_threads()} threads", "shape": args.shape, "dtype": str(dtype).removeprefix("torch."),
              "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "cuda_graphs": graphs, "engine_s": round(engine_s, 3), "engine_tok_s": round(total / engine_s, 1)}
    if not args.skip_hf:
        del runner, engine
        if cuda:
            torch.cuda.empty_cache()
        run_hf(model, prompts, min(args.new_tokens, 8), args.device)  # warm-up
        hf_s = run_hf(model, prompts, args.new_tokens, args.device)
        result.update(hf_generate_s=round(hf_s, 3), hf_generate_tok_s=round(total / hf_s, 1),
                      speedup=round(hf_s / engine_s, 2))
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    mean_context = args.prompt_len + args.new_tokens / 2
    if bandwidth:
        step_s = (weight_bytes + kv_per_token * args.prompts * mean_context) / (bandwidth * 1e9)
        bound = args.prompts / step_s
        result.update(bandwidth_gbs=bandwidth, bandwidth_bound_tok_s=round(bound, 1),
                      fraction_of_bound=round(total / engine_s / bound, 3))
    if args.shape == "qwen3-1.7b" and cuda:
        result["target_tok_s"] = 25000
        result["target_met"] = total / engine_s >= 25000
    print(json.dumps(result))


if __name__ == "__main__":
    main()
