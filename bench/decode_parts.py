"""The parts of one decode step timed alone on a GPU, one JSON line per measurement.

    python bench/decode_parts.py [--slots 256] [--mean-context 256] [--attention] [--sampling] [--gemms] [--gemm-backends]

``--attention``: our Triton decode kernel (``decode_kernel.decode_attention``) over one layer's slot cache
at the Qwen3-1.7B shape (8 KV heads of 128, 16 query heads, bf16), slot lengths spread evenly over
``mean-context +- 128`` (``--equal-lengths``: all at ``mean-context``, as in a benchmark batch;
``--shuffled-lengths``: the spread in random slot order, as in an RL batch), for every
launch setting of a small grid (positions per iteration, warps, pipeline stages, sequence splits; ``--quick``
a smaller one; ``--slots-per-program 1,4,8`` adds grouped programs); ``--write-new``: as the engine calls
it, writing the step's keys and values too, and with ``--rope`` applying Qwen3's Q/K norms and the rotary
(``decode_kernel.Rope``, as the engine calls it on a GPU); ``--settings 64x4x3,64x4x4`` times exactly those
launches (positions, warps, stages) instead of the grid; ``--kernel-files a.py,b.py`` times other copies of
``decode_kernel.py`` (a candidate edit, the last commit's) beside the installed one, setting by setting, so a
change to the kernel is measured against its predecessor in one process. Reports microseconds per call and the
fraction of the bandwidth bound (the K and V bytes the call must read / 4.8 TB/s). First (unless
``--no-ceiling``), the read ceiling: the same bytes loaded in
the same tiles and summed, no attention (``read_ceiling``), and torch's sum over the whole cache.

``--sampling``: the one-pass sampler (``sampling_kernel.fused_sample``) over the step's ``[slots, 151936]`` bf16
logits, greedy and at temperature 1 (``--kernel-files``: copies of ``sampling_kernel.py`` beside it; ``--settings
4096x8x4,2048x8x8`` also times the installed kernel at those launches, BLOCKxWARPSxPROGRAMS_PER_SM, each checked
to draw the default launch's tokens, sampled ones up to the rounding of the sums: ``same_tokens``).

``--gemms``: the decode step's matmuls at ``M = slots`` rows, as the engine runs them (Q, K, V separately;
gate and up separately) and fused (one ``[Q; K; V]`` matmul; one ``[gate; up]`` matmul), in microseconds
per layer and against the weight-read bound.

``--gemm-backends``: each of the step's matmul shapes at ``M = slots`` (fused Q/K/V, o_proj, fused gate/up,
down, the output layer) over as many weight copies as a step reads (28 layers; 2 of the output layer), so
no weight is still in L2 when it is read again, as in the step: cuBLAS (``F.linear``), cuBLASLt
(``torch.backends.cuda.preferred_blas_library``), ``addmm`` with a residual (the output projections as one
kernel with the add), the same product in other operand layouts (``W @ x^T``; ``x`` column-major; weights
stored ``[K, N]``), split-K through cuBLAS (``--splitk 2,4``: the K range cut in S pieces, one strided batched
matmul with float32 outputs ``[S, M, N]`` (``torch.bmm(out_dtype=)``, no copy of either operand), summed and rounded
to bf16 after, and the batched matmul alone, since the engine would fold the sum into the next fused kernel),
and (unless ``--no-triton-gemms``) a plain Triton matmul (``skinny_mm`` below) over a grid
of tiles, warps, stages and split-K; microseconds per matmul and TFLOP/s.

``--overlap``: whether a step's two halves overlap the memory-bound attention of one with the compute-bound
matmuls of the other. A step's 28 layers (the decode attention with the rotary and the cache write, then
cuBLAS's Q/K/V, o_proj, gate/up and down matmuls; norms and SwiGLU left out), each layer its own weights and
cache, as one CUDA graph: all ``slots`` rows on one stream (``full``), the two halves one after the other
(``halves_serial``), and the two halves on two streams forked inside the graph (``halves_overlap``, also with the
attention's stream at high priority); and the attention and the matmuls alone. Microseconds a step.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re

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

    from posttrain.plugins.engines.local import decode_kernel

    kernels = {"posttrain": decode_kernel}  # name -> a module with decode_attention (and Rope)
    for path in filter(None, args.kernel_files.split(",")):
        kernels[path] = kernel_module(path)
    nb, hkv, g, d, span = args.slots, 8, 2, 128, args.mean_context + 256
    dev = torch.device("cuda")
    k = torch.randn(nb, hkv, span, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(nb, hkv * g, d, dtype=torch.bfloat16, device=dev)
    lengths = torch.linspace(args.mean_context - 128, args.mean_context + 128, nb, device=dev).round().long()
    if args.equal_lengths:  # every slot at the mean (a benchmark batch: same prompt length, same step)
        lengths = torch.full((nb,), args.mean_context, device=dev)
    if args.shuffled_lengths:  # the same spread in random slot order (an RL batch: neighbours differ)
        lengths = lengths[torch.randperm(nb, generator=torch.Generator().manual_seed(0)).to(dev)]
    kv_bytes = int(lengths.sum()) * hkv * d * 2 * 2
    bound_us = 1e6 * kv_bytes / BANDWIDTH
    out = torch.empty(nb, hkv * g, d, dtype=torch.bfloat16, device=dev)
    new = {}
    if args.write_new:  # the engine's call: the kernel also writes this step's K/V row at lengths - 1
        new = {"k_new": torch.randn(nb, hkv, d, dtype=torch.bfloat16, device=dev),
               "v_new": torch.randn(nb, hkv, d, dtype=torch.bfloat16, device=dev)}
    rope = None
    if args.rope:  # Qwen3's Q/K norms and the rotary applied by the kernel (the engine's default on a GPU)
        angle = torch.rand(nb, d, device=dev) * 6
        rope = (angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16),
                torch.rand(d, device=dev).to(torch.bfloat16) + 0.5, torch.rand(d, device=dev).to(torch.bfloat16) + 0.5)
    if not args.no_ceiling:
        read_ceiling(k, v, lengths, bound_us, args)
    groups = [int(p) for p in args.slots_per_program.split(",")]
    # (sequence splits, slots per program): grouped programs run one split
    layouts = [(splits, 1) for splits in ((1, 2, 3) if args.quick else (1, 2, 4))] + [(1, p) for p in groups if p > 1]
    if 1 not in groups:
        layouts = [(1, p) for p in groups]
    grid = ((32, 64, 128), (4, 8), (2, 3)) if args.quick else ((32, 64, 128), (2, 4, 8), (1, 2, 3, 4))
    settings = list(itertools.product(*grid))
    if args.settings:  # exact launch settings, BLOCKxWARPSxSTAGES
        settings = [tuple(int(x) for x in one.split("x")) for one in args.settings.split(",")]
    # each kernel copy in turn for every setting, so the copies are timed back to back
    for (block, warps, stages), (splits, group), name in itertools.product(settings, layouts, kernels):
        dk = kernels[name]
        row = {"bench": "decode_attention", "kernel": name, "slots": nb, "mean_context": args.mean_context,
               "equal_lengths": args.equal_lengths, "shuffled_lengths": args.shuffled_lengths,
               "write_new": args.write_new, "rope": args.rope, "block_n": block,
               "num_warps": warps, "num_stages": stages, "num_splits": splits, "slots_per_program": group}
        extra = dict(new, **({"rope": dk.Rope(*rope)} if rope is not None else {}))
        try:
            us = bench_us(lambda: dk.decode_attention(q, k, v, lengths, 0.088, out=out, num_splits=splits,
                                                      block_n=block, num_warps=warps, num_stages=stages,
                                                      slots_per_program=group, **extra))
            row.update(us=us, bound_us=round(bound_us, 2), fraction_of_bound=round(bound_us / us, 3))
        except Exception as exc:  # noqa: BLE001 - a setting that does not fit (shared memory) is reported
            row["error"] = repr(exc)[:200]
        print(json.dumps(row), flush=True)


def sampling(args) -> None:
    """The decode step's one-pass sampler (``sampling_kernel.fused_sample``) alone over ``[slots, 151936]`` bf16
    logits, greedy and at temperature 1, in us per call, against the read bound (the logits' bytes / 4.8 TB/s);
    ``--kernel-files``: other copies of ``sampling_kernel.py`` beside the installed one."""
    import torch

    from posttrain.plugins.engines.local import sampling_kernel

    kernels = {"posttrain": sampling_kernel}
    for path in filter(None, args.kernel_files.split(",")):
        kernels[path] = kernel_module(path)
    logits = (torch.randn(args.slots, 151936, device="cuda") * 3).to(torch.bfloat16)
    bound_us = 1e6 * logits.numel() * logits.element_size() / BANDWIDTH
    settings = [tuple(int(x) for x in s.split("x")) for s in filter(None, args.settings.split(","))]
    runs = [(name, None) for name in kernels] + [("posttrain", s) for s in settings]
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    for temperature, (name, setting) in itertools.product((0.0, 1.0), runs):
        launch = {} if setting is None else dict(zip(("block", "num_warps", "programs_per_sm"), setting))
        sample = functools.partial(kernels[name].fused_sample, logits, temperature, seed=seed, **launch)
        same = None
        if setting is not None:  # every launch draws what the default draws (sampled: up to the sums' rounding)
            same = (sample()[0] == kernels["posttrain"].fused_sample(logits, temperature, seed=seed)[0]).float().mean()
            same = round(float(same), 4)
            assert same == 1.0 or (temperature > 0 and same >= 0.98), f"{setting}: other tokens ({same}) at {temperature}"
        us = bench_us(sample)
        print(json.dumps({"bench": "fused_sample", "kernel": name, "rows": args.slots, "temperature": temperature,
                          "launch": launch or "default", "same_tokens": same, "us": us, "bound_us": round(bound_us, 2),
                          "fraction_of_bound": round(bound_us / us, 3)}), flush=True)


def kernel_module(path: str):
    """Another copy of a kernel module (``decode_kernel.py``, ``sampling_kernel.py``: a candidate edit, or the last
    commit's) loaded as a module of its own from ``path``, for ``--kernel-files``: its kernels compile apart from the
    installed ones."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(f"kernel_copy_{pathlib.Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_ceiling(k, v, lengths, bound_us: float, args) -> None:
    """What reading the same K/V bytes costs without attention: a Triton kernel that loads each (slot, KV
    head)'s valid positions in the attention's tiles and sums them (one program per (slot, KV head)), and
    torch's sum over the cache (every position, for reference: more bytes than the attention reads)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def read_tiles(K, V, LENS, OUT, stride_kb, stride_kh, stride_ks, D: tl.constexpr, BLOCK: tl.constexpr):
        slot, head = tl.program_id(0), tl.program_id(1)
        n = tl.load(LENS + slot)
        offs_n, offs_d = tl.arange(0, BLOCK), tl.arange(0, D)
        base = slot.to(tl.int64) * stride_kb + head * stride_kh
        total = tl.zeros([BLOCK, D], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            pos = start + offs_n
            mask = (pos < n)[:, None]
            ptrs = base + pos[:, None] * stride_ks + offs_d[None, :]
            total += tl.load(K + ptrs, mask=mask, other=0.0).to(tl.float32)
            total += tl.load(V + ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + slot * tl.num_programs(1) + head, tl.sum(tl.sum(total, 1), 0))

    nb, hkv, _, d = k.shape
    sums = torch.empty(nb * hkv, dtype=torch.float32, device=k.device)
    for block, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
        row = {"bench": "read_ceiling", "slots": nb, "mean_context": args.mean_context,
               "equal_lengths": args.equal_lengths, "block_n": block, "num_warps": warps, "num_stages": stages}
        try:
            us = bench_us(lambda: read_tiles[(nb, hkv)](k, v, lengths, sums, *k.stride()[:3], D=d, BLOCK=block,
                                                        num_warps=warps, num_stages=stages))
            row.update(us=us, bound_us=round(bound_us, 2), fraction_of_bound=round(bound_us / us, 3))
        except Exception as exc:  # noqa: BLE001 - reported, as the attention's settings are
            row["error"] = repr(exc)[:200]
        print(json.dumps(row), flush=True)
    whole = k.numel() * 2 * k.element_size()
    us = bench_us(lambda: (k.sum(), v.sum()))
    print(json.dumps({"bench": "read_ceiling_torch_sum", "bytes": whole, "us": us,
                      "tb_per_s": round(whole / us / 1e6, 3)}), flush=True)


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


def overlap(args) -> None:
    import torch

    from posttrain.plugins.engines.local import decode_kernel as dk

    dev, bf = torch.device("cuda"), torch.bfloat16
    nb, hkv, g, d, layers, ctx = args.slots, 8, 2, 128, 28, args.mean_context
    hidden, inter = 2048, 6144
    span = ctx + 8
    k = [torch.randn(nb, hkv, span, d, dtype=bf, device=dev) for _ in range(layers)]
    v = [torch.randn_like(t) for t in k]
    w = [{"qkv": torch.randn(4096, hidden, dtype=bf, device=dev) * 0.02,
          "o": torch.randn(hidden, hidden, dtype=bf, device=dev) * 0.02,
          "gate_up": torch.randn(2 * inter, hidden, dtype=bf, device=dev) * 0.02,
          "down": torch.randn(hidden, inter, dtype=bf, device=dev) * 0.02} for _ in range(layers)]
    x = torch.randn(nb, hidden, dtype=bf, device=dev)
    h = torch.randn(nb, inter, dtype=bf, device=dev)
    q = torch.randn(nb, hkv * g, d, dtype=bf, device=dev)
    k_new, v_new = torch.randn(nb, hkv, d, dtype=bf, device=dev), torch.randn(nb, hkv, d, dtype=bf, device=dev)
    lengths = torch.full((nb,), ctx, device=dev)
    angle = torch.rand(nb, d, device=dev) * 6
    rope = (angle.cos().to(bf), angle.sin().to(bf), torch.rand(d, device=dev).to(bf) + 0.5,
            torch.rand(d, device=dev).to(bf) + 0.5)
    att_out = torch.empty(nb, hkv * g, d, dtype=bf, device=dev)
    outs = {n: torch.empty(nb, o, dtype=bf, device=dev) for n, o in
            (("qkv", 4096), ("o", hidden), ("gate_up", 2 * inter), ("down", hidden))}

    def attend(lo, hi, layer):
        dk.decode_attention(q[lo:hi], k[layer][lo:hi], v[layer][lo:hi], lengths[lo:hi], 0.088, out=att_out[lo:hi],
                            k_new=k_new[lo:hi], v_new=v_new[lo:hi], rope=dk.Rope(*(t[lo:hi] if t.dim() == 2 else t
                                                                                  for t in rope)))

    def matmuls(lo, hi, layer):
        torch.matmul(x[lo:hi], w[layer]["qkv"].t(), out=outs["qkv"][lo:hi])
        torch.matmul(att_out[lo:hi].view(hi - lo, -1), w[layer]["o"].t(), out=outs["o"][lo:hi])
        torch.matmul(x[lo:hi], w[layer]["gate_up"].t(), out=outs["gate_up"][lo:hi])
        torch.matmul(h[lo:hi], w[layer]["down"].t(), out=outs["down"][lo:hi])

    def step(lo, hi, parts=(attend, matmuls)):
        for layer in range(layers):
            for part in parts:
                part(lo, hi, layer)

    half = nb // 2

    def overlapped(priority: int):
        side = torch.cuda.Stream(priority=priority)

        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                step(half, nb)
            step(0, half)
            main.wait_stream(side)
        return run

    variants = {"full": lambda: step(0, nb), "halves_serial": lambda: (step(0, half), step(half, nb)),
                "halves_overlap": overlapped(0), "halves_overlap_priority": overlapped(-1),
                "attention_only": lambda: step(0, nb, (attend,)), "matmuls_only": lambda: step(0, nb, (matmuls,)),
                "half_attention_only": lambda: step(0, half, (attend,)),
                "half_matmuls_only": lambda: step(0, half, (matmuls,))}
    for name, fn in variants.items():
        us = bench_us(fn, iters=5)
        print(json.dumps({"bench": "decode_overlap", "variant": name, "slots": nb, "context": ctx, "layers": layers,
                          "us_per_step": us, "tok_s_at_step": round(nb / us * 1e6)}), flush=True)


def _skinny_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, SPLIT: tl.constexpr):
        """``Y[M, N] (+)= X[M, K] @ W[N, K]^T`` over one ``BM x BN`` tile and the ``pid_k``-th of ``SPLIT``
        K ranges; with ``SPLIT > 1``, ``Y`` is float32 and the ranges add up atomically. K is a multiple
        of ``BK * SPLIT`` (the bench's shapes)."""
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        span = K // SPLIT
        k0 = pid_k * span
        x_ptrs = X + rm[:, None] * stride_xm + (k0 + rk)[None, :]
        w_ptrs = W + rn[:, None] * stride_wn + (k0 + rk)[None, :]
        mask_m, mask_n = rm < M, rn < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for _ in range(0, span, BK):
            a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            acc += tl.dot(a, tl.trans(b))
            x_ptrs += BK
            w_ptrs += BK
        y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT == 1:
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)

    return kernel


def skinny_mm(x, w, bm: int, bn: int, bk: int, split: int, warps: int, stages: int, kernel):
    """``x [M, K] @ w[N, K]^T`` with the Triton kernel; split-K adds into a zeroed float32 buffer, then casts."""
    import torch

    m, k = x.shape
    n = w.shape[0]
    grid = (-(-n // bn), -(-m // bm), split)
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, SPLIT=1,
                     num_warps=warps, num_stages=stages)
        return y
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, SPLIT=split,
                 num_warps=warps, num_stages=stages)
    return y.to(x.dtype)


def splitk_mm(x, w, splits: int, summed: bool = True):
    """``x [M, K] @ w[N, K]^T`` as ``splits`` products over K ranges, one strided batched cuBLAS call with float32
    outputs ``[S, M, N]``; ``summed``: their sum rounded to ``x``'s dtype (else the float32 partials)."""
    import torch

    m, k = x.shape
    n = w.shape[0]
    a = x.view(m, splits, k // splits).transpose(0, 1)  # [S, M, K/S], row-major, ld K
    b = w.view(n, splits, k // splits).permute(1, 2, 0)  # [S, K/S, N], column-major, ld K
    parts = torch.bmm(a, b, out_dtype=torch.float32)
    return parts.sum(0).to(x.dtype) if summed else parts


GEMM_SHAPES = (("qkv", 4096, 2048, 28), ("o", 2048, 2048, 28), ("gate_up", 12288, 2048, 28),
               ("down", 2048, 6144, 28), ("lm_head", 151936, 2048, 2))  # (part, N, K, weight copies)
SKINNY_CONFIGS = ((64, 64, 64, 1, 4, 4), (64, 64, 128, 1, 4, 3), (64, 128, 64, 1, 4, 4), (128, 64, 64, 1, 4, 4),
                  (64, 128, 128, 1, 8, 3), (128, 128, 64, 1, 8, 3), (64, 64, 64, 1, 4, 6), (32, 64, 128, 1, 4, 4),
                  (64, 64, 64, 2, 4, 4), (64, 128, 64, 2, 4, 4), (128, 128, 64, 2, 8, 3), (64, 64, 128, 4, 4, 3))


def gemm_backends(args) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    m = args.slots
    kernel = _skinny_kernel()
    for part, n, k, copies in GEMM_SHAPES:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        res = torch.randn(m, n, dtype=torch.bfloat16, device=dev)
        ref = F.linear(x, ws[0]).float()
        flop = 2 * m * n * k

        def report(backend, fn, check=None, **extra):
            row = {"bench": "decode_gemm_backend", "part": part, "m": m, "n": n, "k": k, "backend": backend, **extra}
            try:
                if check is not None:
                    err = (check().float() - ref).abs().max().item()
                    row["max_abs_err"] = round(err, 4)
                us = bench_us(lambda: [fn(w) for w in ws], iters=10) / copies
                row.update(us=round(us, 2), tflops=round(flop / us / 1e6, 1),
                           weight_bound_us=round(1e6 * n * k * 2 / BANDWIDTH, 2))
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported
                row["error"] = repr(exc)[:200]
            print(json.dumps(row), flush=True)

        report("cublas", lambda w: F.linear(x, w))
        before = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            report("cublaslt", lambda w: F.linear(x, w), check=lambda: F.linear(x, ws[0]))
        finally:
            torch.backends.cuda.preferred_blas_library(before)
        report("addmm_residual", lambda w: torch.addmm(res, x, w.t()),
               check=lambda: torch.addmm(res, x, ws[0].t()) - res)
        # the same product in other operand layouts, which cuBLAS's heuristics map to other kernels (tiles):
        # W @ x^T, the activations column-major ([K, M] in memory), every weight copy stored [K, N]
        x_cols, w_t = x.t().contiguous().t(), {id(w): w.t().contiguous() for w in ws}
        layouts = {"out_transposed": lambda w, x=x: torch.mm(w, x.t()).t(),
                   "x_column_major": lambda w, x=x_cols: F.linear(x, w),
                   "w_k_major": lambda w, x=x, w_t=w_t: torch.mm(x, w_t[id(w)])}
        for name, fn in layouts.items():
            report(name, fn, check=functools.partial(fn, ws[0]))
        w_t.clear()
        for splits in (int(one) for one in filter(None, args.splitk.split(","))):
            if k % splits or part == "lm_head":  # the output layer: 151,936 columns fill the GPU unsplit
                continue
            for name, fn in (("splitk", functools.partial(splitk_mm, x, splits=splits)),
                             ("splitk_gemm_only", functools.partial(splitk_mm, x, splits=splits, summed=False))):
                report(name, fn, check=functools.partial(splitk_mm, x, ws[0], splits=splits), splits=splits)
        for bm, bn, bk, split, warps, stages in () if args.no_triton_gemms else SKINNY_CONFIGS:
            cfg = dict(bm=bm, bn=bn, bk=bk, split=split, warps=warps, stages=stages)
            if k % (bk * split):
                continue
            report("triton", lambda w, c=cfg: skinny_mm(x, w, kernel=kernel, **c),
                   check=lambda c=cfg: skinny_mm(x, ws[0], kernel=kernel, **c), **cfg)
        ws.clear()  # the weight copies' memory back before the next part (the closures above keep the list)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--mean-context", type=int, default=256)
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--sampling", action="store_true")
    ap.add_argument("--gemms", action="store_true")
    ap.add_argument("--gemm-backends", action="store_true")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--equal-lengths", action="store_true", help="--attention: every slot at --mean-context")
    ap.add_argument("--quick", action="store_true", help="--attention: a smaller grid of launch settings")
    ap.add_argument("--shuffled-lengths", action="store_true",
                    help="--attention: the spread of lengths in random slot order (neighbouring slots differ)")
    ap.add_argument("--write-new", action="store_true", help="--attention: the kernel also writes the step's K/V")
    ap.add_argument("--rope", action="store_true",
                    help="--attention with --write-new: the kernel also norms and rotates q and the new key (Qwen3)")
    ap.add_argument("--settings", default="", help="--attention: launch settings BLOCKxWARPSxSTAGES, comma-separated "
                                                   "(instead of the grid); --sampling: BLOCKxWARPSxPROGRAMS_PER_SM")
    ap.add_argument("--kernel-files", default="", help="--attention / --sampling: other copies of decode_kernel.py / "
                                                       "sampling_kernel.py, comma-separated, timed beside the installed one")
    ap.add_argument("--no-ceiling", action="store_true", help="--attention: skip the read ceiling")
    ap.add_argument("--no-triton-gemms", action="store_true", help="--gemm-backends: skip the Triton matmul grid")
    ap.add_argument("--splitk", default="", help="--gemm-backends: split-K counts, comma-separated (cuBLAS batched)")
    ap.add_argument("--slots-per-program", default="1",
                    help="--attention: comma-separated slots per program (decode_attention(slots_per_program=)); "
                         "without 1 in the list, only grouped layouts are timed")
    args = ap.parse_args()
    bad = [one for one in filter(None, args.settings.split(",")) if not re.fullmatch(r"\d+x\d+x\d+", one)]
    if bad:
        ap.error(f"--settings: expected BLOCKxWARPSxN entries such as 64x4x3, got {', '.join(bad)}")
    if args.attention:
        attention(args)
    if args.sampling:
        sampling(args)
    if args.gemms:
        gemms(args)
    if args.gemm_backends:
        gemm_backends(args)
    if args.overlap:
        overlap(args)


if __name__ == "__main__":
    main()
