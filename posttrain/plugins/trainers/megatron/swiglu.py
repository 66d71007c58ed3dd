"""The prob-weighted SwiGLU of MoE experts, forward and backward, one pass over the rows each.

For ``h = [g, u]`` (``[N, 2F]``, the experts' first GEMM) and routing probs ``p [N]``::

    s = silu(g) * u                      a = (p * s).to(dtype)                         (forward, [N, F])
    da -> dp = sum_f da * s,  ds = p * da,  dg = ds * u * silu'(g),  du = ds * silu(g)  (backward)

with ``silu'(g) = sig(g) (1 + g (1 - sig(g)))``, all in fp32. The backward also gives ``a`` again (the
down projection's weight gradient needs it; recomputing it costs less than keeping it between the passes).

On CUDA each is one Triton kernel (one read of ``h`` and ``da``, one write of each result); elsewhere, or
without Triton, the same formulas in torch ops (about twenty elementwise passes). :func:`use_triton`
decides; ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernels
    triton = tl = None

ROWS = 4  # rows per program; the whole row of F columns in one block


if triton is not None:

    @triton.jit
    def _fwd_kernel(H, P, A, N, F_, stride_h, stride_a, BLOCK_F: tl.constexpr, BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BLOCK_F)
        mask = (rows < N)[:, None] & (cols < F_)[None, :]
        hrow = H + rows[:, None].to(tl.int64) * stride_h + cols[None, :]
        g = tl.load(hrow, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(hrow + F_, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(P + rows, mask=rows < N, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u * p[:, None]
        tl.store(A + rows[:, None].to(tl.int64) * stride_a + cols[None, :], a.to(A.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(H, P, DA, A, DH, DP, N, F_, stride_h, stride_da, stride_a, stride_dh,
                    BLOCK_F: tl.constexpr, BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.arange(0, BLOCK_F)
        mask = (rows < N)[:, None] & (cols < F_)[None, :]
        r64 = rows[:, None].to(tl.int64)
        hrow = H + r64 * stride_h + cols[None, :]
        g = tl.load(hrow, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(hrow + F_, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(P + rows, mask=rows < N, other=0.0).to(tl.float32)
        da = tl.load(DA + r64 * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        s = silu * u
        tl.store(A + r64 * stride_a + cols[None, :], (s * p[:, None]).to(A.dtype.element_ty), mask=mask)
        tl.store(DP + rows, tl.sum(da * s, axis=1).to(DP.dtype.element_ty), mask=rows < N)
        ds = da * p[:, None]
        dhrow = DH + r64 * stride_dh + cols[None, :]
        tl.store(dhrow, (ds * u * sig * (1 + g * (1 - sig))).to(DH.dtype.element_ty), mask=mask)
        tl.store(dhrow + F_, (ds * silu).to(DH.dtype.element_ty), mask=mask)


def use_triton(h: torch.Tensor) -> bool:
    """The kernels run: Triton imported and ``h`` on CUDA, or the Triton interpreter on (CPU tests)."""
    return triton is not None and (h.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def swiglu_forward(h: torch.Tensor, probs: torch.Tensor, triton_ok: bool | None = None) -> torch.Tensor:
    """``h [N, 2F]``, ``probs [N]`` -> ``a = p * silu(g) * u`` ``[N, F]`` in ``h``'s dtype."""
    n, f = h.shape[0], h.shape[1] // 2
    if not (use_triton(h) if triton_ok is None else triton_ok) or n == 0:
        gate, up = h.float().chunk(2, dim=-1)
        return (F.silu(gate) * up * probs.float().unsqueeze(-1)).to(h.dtype)
    h = h.contiguous()
    a = torch.empty(n, f, dtype=h.dtype, device=h.device)
    _fwd_kernel[(triton.cdiv(n, ROWS),)](h, probs.contiguous(), a, n, f, h.stride(0), a.stride(0),
                                         BLOCK_F=triton.next_power_of_2(f), BR=ROWS)
    return a


def swiglu_backward(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor,
                    triton_ok: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a [N, F], dh [N, 2F], dprobs [N])`` for ``h``, ``probs`` and the gradient ``da [N, F]`` of ``a``:
    ``a`` and ``dh`` in ``h``'s dtype, ``dprobs`` in ``probs``'."""
    n, f = h.shape[0], h.shape[1] // 2
    if not (use_triton(h) if triton_ok is None else triton_ok) or n == 0:
        gate, up = h.float().chunk(2, dim=-1)
        pf, daf = probs.float().unsqueeze(-1), da.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        s = silu * up
        ds = daf * pf
        dh = torch.cat([ds * up * sig * (1 + gate * (1 - sig)), ds * silu], dim=-1).to(h.dtype)
        return (s * pf).to(h.dtype), dh, (daf * s).sum(-1).to(probs.dtype)
    h, da = h.contiguous(), da.contiguous()
    a = torch.empty(n, f, dtype=h.dtype, device=h.device)
    dh = torch.empty_like(h)
    dprobs = torch.empty(n, dtype=probs.dtype, device=h.device)
    _bwd_kernel[(triton.cdiv(n, ROWS),)](h, probs.contiguous(), da, a, dh, dprobs, n, f, h.stride(0), da.stride(0),
                                         a.stride(0), dh.stride(0), BLOCK_F=triton.next_power_of_2(f), BR=ROWS)
    return a, dh, dprobs
