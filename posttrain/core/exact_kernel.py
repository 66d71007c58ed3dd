"""The CUDA side of :mod:`posttrain.core.exact`: one Triton batched matmul of fixed blocks.

``c[b] = a[b] @ b[b]`` with ``a [B, M, K]``, ``b [B, K, N]``: program ``(i, j, b)`` computes the output block
``[BM, BN]`` at rows ``i * BM``, columns ``j * BN`` with an fp32 accumulator, ``acc = dot(a_k, b_k, acc)`` over
``K`` in chunks of ``BK`` from 0 upwards (no split-K, no autotuning: one compiled kernel per dtype). Element
``(m, n)`` is thus the same dot product of row ``m`` and column ``n`` whatever ``M``, ``N``, ``B`` or the other
rows hold (out-of-range rows and columns load as zeros), and since a chunk of zeros adds exact zeros to the
accumulator, also whatever zero tail ``K`` carries past the data (``exact.attention`` and ``exact.row_sum`` use
this to run one product over a padded key span or vocabulary). ``M`` and ``N`` are not specialized on, so a
decode row and a training batch run the same machine code. fp32 inputs multiply in IEEE fp32 (no TF32).

``TRITON_INTERPRET=1`` runs it on CPU tensors (tests of its indexing; the CPU's exact mode uses torch tiles).
"""

from __future__ import annotations

import os

import torch

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernel
    triton = tl = None

BM, BN, BK = 64, 64, 32


def triton_ok() -> bool:
    """Whether the kernel can run: Triton imports and either CUDA is there or the interpreter is on."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit(do_not_specialize=["M", "N"])
    def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_base = a_ptr + pid_b.to(tl.int64) * s_ab + rm[:, None].to(tl.int64) * s_am
        b_base = b_ptr + pid_b.to(tl.int64) * s_bb + rn[None, :].to(tl.int64) * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_base + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_base + kk[:, None] * s_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        c = c_ptr + pid_b.to(tl.int64) * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def tiled_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N] -> [B, M, N]`` in ``a``'s dtype through :func:`_bmm_kernel` (``b`` is cast to
    ``a``'s dtype)."""
    bsz, m, k = a.shape
    n = b.shape[2]
    b = b.to(a.dtype)
    out = torch.empty(bsz, m, n, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN), bsz)
    _bmm_kernel[grid](a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(), IEEE=a.dtype == torch.float32,
                      BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return out
