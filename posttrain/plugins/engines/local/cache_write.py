"""A prefill's keys and values into the slot KV cache, one Triton launch per layer (CUDA).

A prefill batch of ``n`` distinct prompts (``model_runner.prefill_scored`` runs each distinct prompt once)
yields one layer's ``k``/``v`` ``[n, Hkv, T, D]`` as views of its projections (``[n, T, Hkv, D]`` memory:
positions are ``Hkv * D`` apart). Slot ``slots[i]`` of the batch's prompt ``i`` gets the rows of distinct
prompt ``rows[i]``: ``cache[slots[i], :, :T] = x[rows[i]]`` for ``x`` in ``k, v``, positions ``0 .. T - 1``
(past a prompt's own length the padding's rows, which nothing reads: attention stops at each length).

In torch that is a gather (``x[rows]``, when prompts repeat, as a GRPO group's do) and then a strided copy per
tensor, which on an H200 ran at ~1.2 TB/s (6.3 ms of a 256 x 128 prefill's 160 ms). :func:`write_prompt_kv`
does both tensors in one pass: each program moves a ``[BLOCK_T, D]`` tile of one (prompt, KV head) from ``k`` and
from ``v``, reading each position's ``D`` values as one contiguous row and writing whole cache rows.
:func:`write_prompt_kv_reference` is the torch version (CPU, and where Triton is missing).
"""

from __future__ import annotations

import contextlib

import torch

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernel
    triton = tl = None

BLOCK_T = 64  # positions per program


if triton is not None:

    @triton.jit
    def _write_kernel(K, V, K_CACHE, V_CACHE, SLOTS, ROWS, width,
                      stride_kn, stride_kh, stride_kt, stride_kd, stride_vn, stride_vh, stride_vt, stride_vd,
                      stride_cs, stride_ch, stride_ct, stride_cd, stride_ws, stride_wh, stride_wt, stride_wd,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
        """One (batch prompt ``i``, KV head, block of positions): ``k``/``v`` rows of distinct prompt ``ROWS[i]``
        into slot ``SLOTS[i]`` of ``K_CACHE`` (strides ``stride_c*``) and ``V_CACHE`` (``stride_w*``)."""
        i = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, BLOCK_D)
        slot = tl.load(SLOTS + i).to(tl.int64)
        row = tl.load(ROWS + i).to(tl.int64)
        mask = (t < width)[:, None] & (d < HEAD_D)[None, :]
        k = tl.load(K + row * stride_kn + h * stride_kh + t[:, None] * stride_kt + d[None, :] * stride_kd, mask=mask)
        v = tl.load(V + row * stride_vn + h * stride_vh + t[:, None] * stride_vt + d[None, :] * stride_vd, mask=mask)
        tl.store(K_CACHE + slot * stride_cs + h * stride_ch + t[:, None] * stride_ct + d[None, :] * stride_cd, k,
                 mask=mask)
        tl.store(V_CACHE + slot * stride_ws + h * stride_wh + t[:, None] * stride_wt + d[None, :] * stride_wd, v,
                 mask=mask)


def write_prompt_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``k_cache[slots[i], :, :T] = k[rows[i]]`` and the same for ``v``, one launch (module docstring).

    ``k``/``v`` ``[n, Hkv, T, D]``, any strides; ``k_cache``/``v_cache`` one layer's ``[N, Hkv, S, D]`` (``S >= T``),
    any strides, of ``k``'s dtype; ``slots``/``rows`` ``[m]`` integer tensors on the device (``rows[i] < n``)."""
    if triton is None:
        raise RuntimeError("write_prompt_kv needs triton; use write_prompt_kv_reference")
    n, hkv, width, d = k.shape
    if v.shape != k.shape or k_cache.shape[1] != hkv or k_cache.shape[3] != d or k_cache.shape[2] < width:
        raise ValueError(f"write_prompt_kv: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("write_prompt_kv: k, v and both caches must share a dtype, and the caches a shape")
    m = slots.shape[0]
    if m == 0 or width == 0:
        return
    block_d = 1 << max(0, d - 1).bit_length()
    with torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext():
        _write_kernel[(m, hkv, -(-width // BLOCK_T))](k, v, k_cache, v_cache, slots, rows, width, *k.stride(),
                                                       *v.stride(), *k_cache.stride(), *v_cache.stride(),
                                                       HEAD_D=d, BLOCK_D=block_d, BLOCK=BLOCK_T, num_warps=4)


def write_prompt_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor | slice, rows: torch.Tensor | None) -> None:
    """:func:`write_prompt_kv` in torch: ``rows`` None when every prompt is distinct and in order (no gather);
    ``slots`` a slice when they are consecutive (a plain copy: an indexed write ran at a tenth of the bandwidth)."""
    width = k.shape[2]
    for cache, x in ((k_cache[:, :, :width], k), (v_cache[:, :, :width], v)):
        cache, x = as_words(cache), as_words(x if rows is None else x[rows])
        if isinstance(slots, slice):
            cache[slots].copy_(x)
        else:
            cache.index_copy_(0, slots, x)


def as_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as 8-byte words along its last dimension where that dimension is contiguous and whole
    words long, else ``x``: a strided copy then moves 8 bytes per element instead of 2 (bf16). The prefill's
    K/V writes into the slot cache (``[n, Hkv, T, D]`` views of ``[n, T, Hkv, D]`` projections) are such copies."""
    if x.dim() and x.stride(-1) == 1 and (x.shape[-1] * x.element_size()) % 8 == 0 and x.element_size() < 8:
        try:
            return x.view(torch.int64)
        except RuntimeError:  # strides or offset not whole words
            pass
    return x
