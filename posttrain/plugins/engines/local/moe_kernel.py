"""The local engine's MoE decode step in a fixed handful of launches: fused routing, two grouped expert GEMMs.

transformers' ``grouped_mm`` experts run a decode step's MoE layer as ~25 launches (router softmax, top-k,
renormalization, sort, gather, histogram, cumsum, two grouped GEMMs with the SwiGLU between them as its
own kernels, weighting, inverse permutation, gather, sum). Here, for ``T`` tokens routed to ``k`` of ``E``
experts (``x [T, H]``, gate/up ``W1 [E, 2F, H]``, down ``W2 [E, H, F]``, transformers' stacked layout):

1. routing: ``logits = x W_r^T`` (one GEMM), then one Triton launch (:func:`route_topk`): Qwen3-MoE's
   ``p = softmax(logits)`` in fp32, the ``k`` largest (lowest index first among ties, as ``torch.topk``),
   renormalized to sum 1 with ``norm_topk_prob``; GLM-4.5's ``s = sigmoid(logits)`` (fp32 logits), the
   ``k`` largest ``s + e_score_correction_bias``, weighted by ``s`` renormalized, times
   ``routed_scaling_factor`` (one expert group; with several its own module runs);
2. alignment (:func:`align_kernel`, one Triton launch; :func:`align` is the same in torch ops; no host
   sync, so a CUDA graph captures it): the ``S = T k``
   (token, slot) pairs sorted by expert and laid out in blocks of ``BLOCK_M`` rows that each belong to one
   expert (an expert's last block padded), ``rows [P]`` (the pair in each row, ``S`` = padding) and
   ``block_expert [P / BLOCK_M]`` (``E`` past the last used block). ``P = ceil((S + E (BLOCK_M - 1)) /
   BLOCK_M) BLOCK_M`` bounds the padded length whatever the routing, so every shape is static;
3. ``_gate_up_kernel``: per (block, ``BLOCK_N`` columns of ``F``), ``a = silu(x_b W1_e[:F]^T) *
   (x_b W1_e[F:]^T)`` with the tokens' rows of ``x`` gathered in the loads, the SwiGLU on the fp32
   accumulators: ``a [P, F]``, no ``[S, 2F]`` intermediate;
4. ``_down_kernel``: per (block, ``BLOCK_N`` columns of ``H``), ``o = w * (a_b W2_e^T)`` (``w`` the pair's
   routing weight) stored at the pair's own row of ``o [S, H]`` (fp32); ``y = o.view(T, k, H).sum(1)``.

Each program streams one expert's weight panel once; a block holds up to ``BLOCK_M`` of that expert's rows
(:func:`block_m`: twice the mean, 32 at 256 tokens with top-8 of 128), so at decode sizes most experts take
one block and the weights are read about once per step: the step is bound by the expert weights' bytes. Above ``MAX_ROWS`` pairs (prefill) the blocks
would re-read each panel many times; transformers' grouped GEMM runs those.

:func:`set_moe_kernel` tags a model's MoE blocks (``layers.mlp_forward`` then calls :func:`moe_forward`);
off by default.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernel
    triton = tl = None

BLOCK_M = 16  # rows of one expert per program: tl.dot's least (``block_m`` picks up to 64 for fuller batches)
BLOCK_N = 64
BLOCK_K = 128
MAX_ROWS = 8192  # (token, slot) pairs up to which the kernels run (decode); above: transformers' grouped GEMM
TAG = "posttrain_moe_kernel"

if triton is not None:

    @triton.jit
    def _route_kernel(LOGITS, BIAS, WEIGHTS, IDS, T, E, stride_t, scale, eps, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_T: tl.constexpr, NORM: tl.constexpr, SIGMOID: tl.constexpr):
        """``BLOCK_T`` tokens' routing over ``E`` logits: scores ``softmax`` (or ``sigmoid``, chosen by score +
        ``BIAS``), the ``K`` best experts (lowest index first among ties) and their scores, renormalized
        (``NORM``: over the ``K``, plus ``eps``) and times ``scale``."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        live = rows < T
        mask = live[:, None] & (cols < E)[None, :]
        x = tl.load(LOGITS + rows[:, None] * stride_t + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            score = tl.where(mask, tl.sigmoid(x), 0.0)
            bias = tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)
            choice = tl.where(mask, score + bias[None, :], float("-inf"))
        else:
            p = tl.where(mask, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
            score = p / tl.sum(p, axis=1)[:, None]
            choice = tl.where(mask, score, float("-inf"))
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(choice, axis=1)
            idx = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
            picked = cols[None, :] == idx[:, None]
            w = tl.sum(tl.where(picked, score, 0.0), axis=1)
            tl.store(IDS + rows * K + j, idx.to(tl.int64), mask=live)
            tl.store(WEIGHTS + rows * K + j, w * scale, mask=live)
            total += w
            choice = tl.where(picked, float("-inf"), choice)
        if NORM:
            for j in tl.static_range(K):
                w = tl.load(WEIGHTS + rows * K + j, mask=live, other=0.0)
                tl.store(WEIGHTS + rows * K + j, w / (total + eps), mask=live)

    @triton.jit
    def _align_kernel(IDS, ROWS, BLOCK_EXPERT, CURSOR, S, E, NUM_ROWS, NUM_BLOCKS, BM: tl.constexpr,
                      BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr):
        """:func:`align` in one program: count the pairs per expert, lay out padded blocks, then place each
        pair at its expert's cursor (an atomic add: the order within an expert varies, the results do not,
        every row being computed and stored on its own)."""
        e_offs = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for start in range(0, S, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(IDS + offs, mask=offs < S, other=BLOCK_E - 1).to(tl.int32)
            counts += tl.histogram(ids, BLOCK_E)
        counts = tl.where(e_offs < E, counts, 0)  # the spare last bin took the masked lanes
        padded = (counts + BM - 1) // BM * BM
        pad_end = tl.cumsum(padded, 0)
        tl.store(CURSOR + e_offs, pad_end - padded)
        for start in range(0, NUM_ROWS, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(ROWS + offs, tl.zeros((CHUNK,), dtype=tl.int32) + S, mask=offs < NUM_ROWS)
        for start in range(0, NUM_BLOCKS, CHUNK_B):  # [CHUNK_B, BLOCK_E] compares: a small tile in registers
            blocks = start + tl.arange(0, CHUNK_B)
            past = (pad_end[None, :] <= (blocks * BM)[:, None]) & (e_offs < E)[None, :]
            tl.store(BLOCK_EXPERT + blocks, tl.sum(past.to(tl.int32), axis=1), mask=blocks < NUM_BLOCKS)
        tl.debug_barrier()  # the cursors and padding rows are written before any pair is placed
        for start in range(0, S, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(IDS + offs, mask=offs < S, other=0).to(tl.int32)
            dest = tl.atomic_add(CURSOR + ids, 1, mask=offs < S)
            tl.store(ROWS + dest, offs, mask=offs < S)

    @triton.jit
    def _gate_up_kernel(X, W1, ROWS, BLOCK_EXPERT, OUT, S, H, F, NUM_E, stride_xt, stride_we, stride_wn, stride_om,
                        TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """``OUT[rows of block m, n-tile] = silu(x W1_e[:F]^T) * (x W1_e[F:]^T)`` for the block's expert ``e``."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        if e >= NUM_E:
            return
        offs_m = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(ROWS + offs_m)
        valid = pair < S
        tok = (pair // TOPK).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < F
        offs_k = tl.arange(0, BK)
        a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
        g_ptr = W1 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptr = g_ptr + F * stride_wn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k_ok = (k0 + offs_k) < H
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            acc_g = tl.dot(a, tl.load(g_ptr, mask=w_mask, other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(u_ptr, mask=w_mask, other=0.0), acc_u)
            a_ptr += BK
            g_ptr += BK
            u_ptr += BK
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        out = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, act.to(OUT.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(A, W2, ROWS, BLOCK_EXPERT, TOPW, OUT, S, F, H, NUM_E, stride_am, stride_we, stride_wn, stride_om,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """``OUT[pair, n-tile] = w_pair * (a_row W2_e^T)`` for the rows of block ``m`` (expert ``e``)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        if e >= NUM_E:
            return
        offs_m = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(ROWS + offs_m)
        valid = pair < S
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BK)
        a_ptr = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptr = W2 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, F, BK):
            k_ok = (k0 + offs_k) < F
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
            a_ptr += BK
            w_ptr += BK
        w = tl.load(TOPW + pair, mask=valid, other=0.0).to(tl.float32)
        out = OUT + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc * w[:, None], mask=valid[:, None] & n_ok[None, :])


def kernel_available(x: torch.Tensor) -> bool:
    """Triton imported and ``x`` a 16-bit CUDA tensor (fp32 on CUDA would run tf32 dots), or the Triton
    interpreter on the CPU (tests)."""
    import os

    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def route_topk(logits: torch.Tensor, k: int, norm: bool, bias: torch.Tensor | None = None, scale: float = 1.0,
               eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights [T, k] float32, ids [T, k] int64)`` in one launch: without ``bias`` the
    ``k`` largest of ``softmax(logits)`` (fp32); with ``bias [E]`` the ``k`` largest ``sigmoid(logits) + bias``
    weighted by their ``sigmoid``; renormalized to sum 1 (``+ eps``) with ``norm``, times ``scale``."""
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        block_t = 16
        _route_kernel[(triton.cdiv(t, block_t),)](logits, logits if bias is None else bias, weights, ids, t, e,
                                                   logits.stride(0), float(scale), float(eps), K=k,
                                                   BLOCK_E=triton.next_power_of_2(e), BLOCK_T=block_t, NORM=norm,
                                                   SIGMOID=bias is not None)
    return weights, ids


def block_m(pairs: int, num_experts: int) -> int:
    """Rows per block for ``pairs`` (token, slot) pairs over ``num_experts``: twice the mean rows per expert,
    a power of two in ``[16, 64]``, so most experts fit one block and read their weights once (256 tokens,
    top-8 of 128: 32)."""
    want = max(1, -(-2 * pairs // num_experts))
    return min(64, max(BLOCK_M, 1 << (want - 1).bit_length()))


def align(ids: torch.Tensor, num_experts: int, bm: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, k]`` -> ``(rows [P] int32, block_expert [P / bm] int32)`` (module docstring, step 2).
    Row ``r`` holds pair ``rows[r]`` (= ``t k + j``; ``S`` on padding rows); block ``b`` belongs to expert
    ``block_expert[b]`` (``E``: unused). Static shapes, no host sync."""
    flat = ids.reshape(-1)
    s, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pad_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # the expert's first index in sorted order
    expert = flat[order]
    dest = pad_end[expert] - padded[expert] + torch.arange(s, device=dev) - first[expert]
    length = -(-(s + num_experts * (bm - 1)) // bm) * bm
    rows = torch.full((length,), s, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, length, bm, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return rows, block_expert


def align_kernel(ids: torch.Tensor, num_experts: int, bm: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align` as one Triton launch: the same ``block_expert``, and each expert's blocks hold the same
    pairs, in an order that may differ."""
    flat = ids.reshape(-1)
    s = flat.numel()
    length = -(-(s + num_experts * (bm - 1)) // bm) * bm
    rows = torch.empty(length, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(length // bm, dtype=torch.int32, device=flat.device)
    block_e = triton.next_power_of_2(num_experts + 1)  # a spare bin for masked lanes
    cursor = torch.empty(block_e, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, rows, block_expert, cursor, s, num_experts, length, length // bm, BM=bm,
                        BLOCK_E=block_e, CHUNK=1024, CHUNK_B=max(1, 4096 // block_e), num_warps=8)
    return rows, block_expert


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over ``e = ids[t, j]``: ``x [T, H]``,
    ``ids``/``weights [T, k]``, ``w1 [E, 2F, H]``, ``w2 [E, H, F]`` -> ``[T, H]`` in ``x``'s dtype."""
    t, h = x.shape
    k = ids.shape[1]
    e, two_f, _ = w1.shape
    f = two_f // 2
    s = t * k
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    bm = block_m(s, e)
    rows, block_expert = align_kernel(ids, e, bm)
    blocks = block_expert.numel()
    act = torch.empty(rows.numel(), f, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(f, BLOCK_N))](
        x, w1, rows, block_expert, act, s, h, f, e, x.stride(0), w1.stride(0), w1.stride(1), act.stride(0),
        TOPK=k, BM=bm, BN=BLOCK_N, BK=BLOCK_K)
    out = torch.empty(s, h, dtype=torch.float32, device=x.device)
    topw = weights.reshape(-1).contiguous()
    _down_kernel[(blocks, triton.cdiv(h, BLOCK_N))](
        act, w2, rows, block_expert, topw, out, s, f, h, e, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BM=bm, BN=BLOCK_N, BK=BLOCK_K)
    return out.view(t, k, h).sum(1).to(x.dtype)


def route(gate: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], ids [T, k])`` of a transformers MoE router on ``x [T, H]``: one GEMM and one fused
    launch (:func:`route_topk`) for Qwen3-MoE's softmax router and GLM-4.5's sigmoid router with one
    expert group (both presets), the router's own forward otherwise (several groups)."""
    name = type(gate).__name__
    if name == "Qwen3MoeTopKRouter":
        logits = torch.nn.functional.linear(x, gate.weight)
        return route_topk(logits, int(gate.top_k), bool(gate.norm_topk_prob))
    if name == "Glm4MoeTopkRouter" and int(gate.num_group) == 1:  # one group: no group selection
        logits = torch.nn.functional.linear(x.float(), gate.weight.float())
        return route_topk(logits, int(gate.top_k), bool(gate.norm_topk_prob), bias=gate.e_score_correction_bias,
                          scale=float(gate.routed_scaling_factor), eps=1e-20)
    _, weights, ids = gate(x)
    return weights, ids


def applies(experts: Any) -> bool:
    """A transformers stacked-experts module this kernel computes: SwiGLU, ``gate_up_proj [E, 2F, H]``,
    ``down_proj [E, H, F]``, no biases, not transposed."""
    act = getattr(experts, "act_fn", None)
    silu = act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation")
    w1, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (silu and isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.dim() == 3
            and w2.dim() == 3 and w1.shape[1] == 2 * w2.shape[2] and w1.shape[2] == w2.shape[1]
            and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_bias", False))


def set_moe_kernel(model: Any, on: bool) -> int:
    """Tag (``on``) or untag every MoE block of ``model`` whose experts :func:`applies` holds for; the
    number of blocks tagged. ``layers.mlp_forward`` runs tagged blocks through :func:`moe_forward`."""
    tagged = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if experts is not None and hasattr(module, "gate") and applies(experts):
            setattr(module, TAG, bool(on))
            tagged += bool(on)
    return tagged


def moe_forward(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tagged MoE block's routed experts on ``x [T, H]`` -> ``(y [T, H], ids [T, k])`` (shared experts
    not included): the kernels up to :data:`MAX_ROWS` pairs where they run (:func:`kernel_available`), else
    the block's own experts (and, where the kernels do not run, its own router)."""
    experts = mlp.experts
    if not kernel_available(x):
        _, weights, ids = mlp.gate(x)
        return experts(x, ids, weights), ids
    weights, ids = route(mlp.gate, x)
    if ids.numel() > MAX_ROWS:
        return experts(x, ids, weights), ids
    return fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj), ids
