"""The parts of one decode step timed alone on a GPU, one JSON line per measurement (issue 17's decode profile).

    python bench/decode_parts.py [--slots 256] [--mean-context 256] [--attention] [--gemms]

``--attention``: our Triton decode kernel (``decode_kernel.decode_attention``) over one layer's slot cache
at the Qwen3-1.7B shape (8 KV heads of 128, 16 query heads, bf16), slot lengths spread evenly over
``mean-context +- 128``, for every launch setting of a small grid (positions per iteration, warps,
pipeline stages, sequence splits). Reports microseconds per call and the fraction of the bandwidth
bound (the K and V bytes the call must read / 4.8 TB/s).

``--gemms``: the decode step's matmuls at ``M = slots`` rows, as the engine runs them (Q, K, V separately;
gate and up separately) and fused (one ``[Q; K; V]`` matmul; one ``[gate; up]`` matmul), in microseconds
per layer and against the weight-read bound.
"""

from __future__ import annotations

import argparse
import itertools
import json

BANDWIDTH = 4.8e12  # bytes/s, H200 HBM3e


def bench_us(fn, iters: int = 50) -> float:
    """Mean microseconds of ``fn()`` over ``iters`` calls replayed from a CUDA graph (no launch gaps)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(1e3 * start.elapsed_time(end) / (iters * 10), 2)


def attention(args) -> None:
    import torch

    from posttrain.plugins.engines.local.decode_kernel import decode_attention

    nb, hkv, g, d, span = args.slots, 8, 2, 128, args.mean_context + 256
    dev = torch.device("cuda")
    k = torch.randn(nb, hkv, span, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(nb, hkv * g, d, dtype=torch.bfloat16, device=dev)
    lengths = torch.linspace(args.mean_context - 128, args.mean_context + 128, nb, device=dev).round().long()
    kv_bytes = int(lengths.sum()) * hkv * d * 2 * 2
    bound_us = 1e6 * kv_bytes / BANDWIDTH
    out = torch.empty(nb, hkv * g, d, dtype=torch.bfloat16, device=dev)
    for block, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (1, 2, 4)):
        row = {"bench": "decode_attention", "slots": nb, "mean_context": args.mean_context, "block_n": block,
               "num_warps": warps, "num_stages": stages, "num_splits": splits}
        try:
            us = bench_us(lambda: decode_attention(q, k, v, lengths, 0.088, out=out, num_splits=splits,
                                                   block_n=block, num_warps=warps, num_stages=stages))
            row.update(us=us, bound_us=round(bound_us, 2), fraction_of_bound=round(bound_us / us, 3))
        except Exception as exc:  # noqa: BLE001 - a setting that does not fit (shared memory) is reported
            row["error"] = repr(exc)[:200]
        print(json.dumps(row), flush=True)


def gemms(args) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    m, hidden, inter, q_out, kv_out = args.slots, 2048, 6144, 2048, 1024
    x = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev)
    w = {n: torch.randn(o, hidden, dtype=torch.bfloat16, device=dev) * 0.02
         for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", hidden), ("gate", inter), ("up", inter))}
    w["down"] = torch.randn(hidden, inter, dtype=torch.bfloat16, device=dev) * 0.02
    qkv = torch.cat([w["q"], w["k"], w["v"]])
    gate_up = torch.cat([w["gate"], w["up"]])
    h_inter = torch.randn(m, inter, dtype=torch.bfloat16, device=dev)
    parts = {
        "qkv_separate": (lambda: (F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])), qkv),
        "qkv_fused": (lambda: F.linear(x, qkv), qkv),
        "o": (lambda: F.linear(x, w["o"]), w["o"]),
        "gate_up_separate": (lambda: (F.linear(x, w["gate"]), F.linear(x, w["up"])), gate_up),
        "gate_up_fused": (lambda: F.linear(x, gate_up), gate_up),
        "down": (lambda: F.linear(h_inter, w["down"]), w["down"]),
    }
    for name, (fn, weight) in parts.items():
        us = bench_us(fn)
        bound = 1e6 * weight.numel() * 2 / BANDWIDTH
        print(json.dumps({"bench": "decode_gemm", "part": name, "m": m, "us": us, "bound_us": round(bound, 2),
                          "fraction_of_bound": round(bound / us, 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--mean-context", type=int, default=256)
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--gemms", action="store_true")
    args = ap.parse_args()
    if args.attention:
        attention(args)
    if args.gemms:
        gemms(args)


if __name__ == "__main__":
    main()
