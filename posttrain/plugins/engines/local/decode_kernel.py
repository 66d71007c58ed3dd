"""Flash-decoding attention for the decode step of the local engine: one query token per slot, GQA, read
straight from the slot KV cache.

For slot ``b`` with ``n_b = lengths[b]`` valid cache positions, query head ``h`` and its KV head
``j = h // G`` (``G = H / Hkv`` query heads share a KV head)::

    s_t    = scale * <q[b, h], k[b, j, t]>                  t = 0 .. n_b - 1
    out[b, h] = sum_t softmax(s)_t * v[b, j, t]

Positions ``t >= n_b`` are never read. With ``k_new``/``v_new`` (``[nb, Hkv, D]``: this step's keys and
values), the kernel also writes them into the cache at position ``n_b - 1`` and attends to them there (the
loaded tile takes the new row from registers), which saves the decode step two cache-write kernels per
layer. This is the difference from the ``sdpa``/``bmm`` decode paths of
``model_runner``, which attend over a span shared by the whole batch (``max(positions) + 1``, or its
256-rounded bucket inside a CUDA graph) and mask the tail of each row: their cost follows the longest slot
(rounded up), this kernel's follows each slot's own length. A slot with ``n_b <= 0`` gets zeros (finite,
never NaN); lengths past the cache view's span are clamped to it.

- :func:`decode_attention`: the Triton kernel (CUDA). Grid ``(nb, Hkv, splits)``: one program per (slot,
  KV head, sequence chunk) loads the ``G`` query heads of its KV head (padded to 16 rows for ``tl.dot``),
  walks its slot's positions in blocks of ``BLOCK_N``, scores in float32, keeps an online softmax
  (running max and sum) and a float32 accumulator of ``V``. With one split it writes the output directly;
  with several (small batches, where ``nb * Hkv`` programs cannot fill the GPU) each split writes a partial
  (max, sum, accumulator) and a second kernel merges them. The loop bounds come from ``lengths`` read on
  the device, grid and arguments depend only on shapes: it can be captured in a CUDA graph and replayed with
  new ``lengths``.
  With ``slots_per_program`` (default 8) the batch's slots share programs instead: grid ``(ceil(nb / P),
  Hkv)``, the ``P * G`` query rows of a group in one tile, one loop over the group's position blocks
  slot after slot (``_grouped_kernel``), so the loads stay pipelined over ``P`` slots' positions rather than
  restarting for each slot's few blocks: at 256 slots of 256 positions on an H200 that brings a layer's
  attention close to a plain read of the same bytes; over lengths spread +-128 in random slot order it is
  slightly slower (the groups' sums differ, and one wave of programs waits for its longest).
- ``rope=`` (:class:`Rope`): ``q`` and ``k_new`` come raw from the projections, and the kernels RMS-norm (Qwen3's
  per-head Q/K norms) and rotate them as they load them (:func:`_rows`, :func:`_rotated`), so the decode step needs no
  kernel of its own for that (``ModelRunner(rope_in_attention=)``).
- :func:`decode_attention_reference`: the same function in plain torch (float32 math), for CPU and as the
  fallback where Triton or CUDA is missing.
- :func:`triton_available`: whether the kernel can run here.

``triton`` is optional: this module imports without it (``triton_available()`` is then False), and
``model_runner`` imports this module only when ``decode_attention="triton"`` runs.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from posttrain.plugins.engines.local.decode_reference import _as_3d, _check, _checked_rope, _new_rows
from posttrain.plugins.engines.local.decode_reference import (  # noqa: F401 - re-exported with the kernel
    Rope, decode_attention_reference, rotate_reference)

try:  # optional dependency: CPU-only installs have no triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a missing or broken triton only disables the kernel
    triton = tl = None

BLOCK_N = 64  # cache positions per loop iteration (at most; fewer for wide float32 heads, see _block_n)
TILE_BYTES = 16384  # one K or V tile in shared memory: 64 x 128 bf16
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: the G query heads of a KV head are padded to this
MAX_SPLITS = 32
MAX_GROUP_ROWS = 64  # query rows of one grouped program (slots_per_program * G)
GROUP_SLOTS = 8  # slots per program by default (_plan_group)
MIN_SPLIT_POSITIONS = 128  # a sequence chunk covers at least this many positions
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when CUDA is present and ``triton`` imported: :func:`decode_attention` can run."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _rows(X, row_off, offs_d, mask, stride_xd, HEAD_D: tl.constexpr, ROPE: tl.constexpr):
        """Rows of ``X`` starting at element offsets ``row_off`` ``[R]``: an ``[R, BLOCK_D]`` tile in ``X``'s dtype,
        and with ``ROPE`` a second one of each lane's ``rotate_half`` partner (``x[d + D/2]`` below ``D/2``,
        ``x[d - D/2]`` above; else the same tile). The partner's offsets are written as a sum whose halves are
        contiguous, so both tiles load in 16-byte vectors (``(d + D/2) % D`` loaded one element at a time)."""
        x = tl.load(X + row_off[:, None] + offs_d[None, :] * stride_xd, mask=mask, other=0.0)
        xp = x
        if ROPE:
            xp = tl.load(X + row_off[:, None] + _partner(offs_d, HEAD_D)[None, :] * stride_xd, mask=mask, other=0.0)
        return x, xp

    @triton.jit
    def _partner(offs_d, HEAD_D: tl.constexpr):
        """Each lane's ``rotate_half`` partner, ``(d + D/2) % D``, written as a sum whose halves are contiguous."""
        half = HEAD_D // 2
        return offs_d + half - HEAD_D * (offs_d >= half).to(tl.int32)

    @triton.jit
    def _rotary_tables(COS, SIN, cs_off, stride_cd, offs_d, mask):
        """The rotary's ``cos``/``sin`` rows at ``cs_off`` ``[R]``: ``[R, BLOCK_D]`` float32 each."""
        cos = tl.load(COS + cs_off[:, None] + offs_d[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(SIN + cs_off[:, None] + offs_d[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
        return cos, sin

    @triton.jit
    def _norm_weights(W, offs_r, offs_d, mask, HEAD_D: tl.constexpr):
        """A norm weight ``W`` ``[D]`` at every lane and at its ``rotate_half`` partner's: ``[R, BLOCK_D]`` float32 each,
        loaded in the tile's own layout (a ``[D]`` vector would be moved into it through shared memory)."""
        lanes = mask & (offs_d < HEAD_D)[None, :]
        w = tl.load(W + offs_d[None, :] + 0 * offs_r[:, None], mask=lanes, other=0.0).to(tl.float32)
        wp = tl.load(W + _partner(offs_d, HEAD_D)[None, :] + 0 * offs_r[:, None], mask=lanes, other=0.0).to(tl.float32)
        return w, wp

    @triton.jit
    def _rotated(x, xp, cos, sin, w, wp, norm_eps, offs_d, HEAD_D: tl.constexpr, QK_NORM: tl.constexpr):
        """Rows ``x`` (partners ``xp``, from :func:`_rows`) RMS-normed over their head (``QK_NORM``: weight ``w``,
        rounded to ``x``'s dtype after the scaling, as the checkpoint's norm rounds) and rotated: ``x * cos +
        rotate_half(x) * sin`` with ``rotate_half(x)[d] = -x[d + D/2]`` below ``D/2`` and ``x[d - D/2]`` above;
        float32 math, one rounding at the end. The operands are loaded before (:func:`_rotary_tables`, :func:`_norm_weights`), with
        every other load of the program, so their latencies overlap (``w``/``wp``: unread without ``QK_NORM``)."""
        xf = x.to(tl.float32)
        xpf = xp.to(tl.float32)
        if QK_NORM:
            rstd = tl.rsqrt(tl.sum(xf * xf, 1) / HEAD_D + norm_eps)
            xf = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w
            xpf = (xpf * rstd[:, None]).to(x.dtype).to(tl.float32) * wp
        sign = tl.where(offs_d < HEAD_D // 2, -1.0, 1.0)
        return (xf * cos + sign[None, :] * xpf * sin).to(x.dtype)

    @triton.jit
    def _rope(q, q_partner, k_new, k_partner, COS, SIN, cs_off, stride_cd, QW, KW, norm_eps, offs_r, offs_d, mask,
              HEAD_D: tl.constexpr, QK_NORM: tl.constexpr):
        """``q`` and ``k_new`` (``[R, BLOCK_D]``, partners from :func:`_rows`) normed and rotated, the rows'
        ``cos``/``sin`` at ``cs_off`` ``[R]``: every operand (tables, norm weights) is loaded before any math, so
        with the program's other loads they cost one memory latency, not one per stage."""
        cos, sin = _rotary_tables(COS, SIN, cs_off, stride_cd, offs_d, mask)
        qw, qwp, kw, kwp = cos, cos, cos, cos  # unread without QK_NORM
        if QK_NORM:
            qw, qwp = _norm_weights(QW, offs_r, offs_d, mask, HEAD_D=HEAD_D)
            kw, kwp = _norm_weights(KW, offs_r, offs_d, mask, HEAD_D=HEAD_D)
        q = _rotated(q, q_partner, cos, sin, qw, qwp, norm_eps, offs_d, HEAD_D=HEAD_D, QK_NORM=QK_NORM)
        k_new = _rotated(k_new, k_partner, cos, sin, kw, kwp, norm_eps, offs_d, HEAD_D=HEAD_D, QK_NORM=QK_NORM)
        return q, k_new

    @triton.jit(do_not_specialize=["span", "chunk"])
    def _decode_kernel(Q, K, V, LENS, OUT, PART_ACC, PART_M, PART_L, KN, VN, COS, SIN, QW, KW, norm_eps,
                       scale_log2, span, chunk, stride_cb, stride_cd,
                       stride_qb, stride_qh, stride_qd,
                       stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
                       stride_kb, stride_kh, stride_ks, stride_kd,
                       stride_vb, stride_vh, stride_vs, stride_vd,
                       stride_ob, stride_oh, stride_od,
                       G: tl.constexpr, G_PAD: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, WRITE_NEW: tl.constexpr,
                       ROPE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
        """One (slot, KV head, chunk): positions ``[split * chunk, min((split + 1) * chunk, length))``.

        Scores are kept in base 2 (``scale_log2 = scale * log2(e)``, ``exp2``): the same softmax.
        ``WRITE_NEW``: position ``length - 1`` is this step's ``KN``/``VN`` row, not the cache's. The loop
        over the cache stops before it (the loop is the one without ``WRITE_NEW``: a substituted row inside
        the loaded tiles would cost the tiles their path from shared memory into ``tl.dot``, half as much
        time again per layer on an H200); the chunk holding it starts its online softmax from it, from registers, and
        stores it into the cache. ``ROPE``: ``Q`` and ``KN`` are raw projections, normed and rotated here
        (:func:`_rows`, :func:`_rotated`). Everything the step's own rows need is loaded first, with the length, so their
        latencies overlap and nothing waits on memory after the loop. ``PDL``: the kernel is launched while
        the one before it drains (programmatic dependent launch) and reads the lengths (written by earlier
        kernels) before it waits for that one's outputs (``q``, ``k_new``, ``v_new``)."""
        slot = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        heads = tl.num_programs(1) * G
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK)
        mask_g = offs_g < G
        mask_d = offs_d < HEAD_D
        head = kvh * G + offs_g  # query heads of this KV head (rows past G are padding)
        tile = mask_g[:, None] & mask_d[None, :]

        length = tl.load(LENS + slot).to(tl.int32)
        if PDL:  # launched early (programmatic dependent launch): wait for the kernel that wrote q, k_new, v_new
            tl.extra.cuda.gdc_wait()
        # 64-bit slot/head base offsets: across the whole cache they can pass 2**31 elements; the offsets
        # inside one (slot, head) are small (checked on the host)
        q, q_partner = _rows(Q, slot.to(tl.int64) * stride_qb + head * stride_qh, offs_d, tile, stride_qd,
                             HEAD_D=HEAD_D, ROPE=ROPE)
        if WRITE_NEW:  # this step's key in every row ([G_PAD, BLOCK_D], rows alike) and value ([BLOCK_D])
            k_new, k_partner = _rows(KN, slot.to(tl.int64) * stride_knb + kvh * stride_knh + 0 * offs_g, offs_d, tile,
                                     stride_knd, HEAD_D=HEAD_D, ROPE=ROPE)
            v_new = tl.load(VN + slot.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d * stride_vnd,
                            mask=mask_d, other=0.0)
        if ROPE:  # the slot's cos/sin row for every query row
            q, k_new = _rope(q, q_partner, k_new, k_partner, COS, SIN, slot.to(tl.int64) * stride_cb + 0 * offs_g,
                             stride_cd, QW, KW, norm_eps, offs_g, offs_d, tile, HEAD_D=HEAD_D, QK_NORM=QK_NORM)
        length = tl.minimum(tl.maximum(length, 0), span)
        lo = split * chunk
        hi_all = tl.minimum(lo + chunk, length)
        newest = length - 1
        hi = hi_all  # the cache positions this program reads
        k_base = K + slot.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = V + slot.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)  # finite: exp2(m_i - m_new) is 0, never NaN
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        if WRITE_NEW:  # the chunk holding the newest position starts from it, then stores it (nobody else reads it)
            hi = tl.minimum(hi_all, newest)
            at_g = newest + 0 * offs_g  # block masks (the interpreter rejects scalar ones here)
            owns_g = (at_g >= lo) & (at_g < hi_all)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2  # [G_PAD]
            m_i = tl.where(owns_g, s_new, m_i)
            l_i = tl.where(owns_g, 1.0, l_i)
            acc = tl.where(owns_g[:, None], v_new.to(tl.float32)[None, :], acc)
            at_d = newest + 0 * offs_d
            owns_d = mask_d & (at_d >= lo) & (at_d < hi_all)
            tl.store(k_base + newest * stride_ks + offs_d[None, :] * stride_kd + 0 * offs_g[:, None], k_new,
                     mask=(offs_g == 0)[:, None] & owns_d[None, :])  # one row of the alike rows
            tl.store(v_base + newest * stride_vs + offs_d * stride_vd, v_new, mask=owns_d)
        for start in range(lo, hi, BLOCK):
            pos = start + offs_n
            mask_n = pos < hi
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            if IEEE:  # float32 inputs: full-precision products (no TF32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:  # bf16/fp16 inputs, float32 accumulation
                s = tl.dot(q, tl.trans(k))
            s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds at least one valid position
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SPLIT:  # partials [nb, H, splits] (max, sum) and [nb, H, splits, BLOCK_D] (unnormalized sum of V)
            row = (slot.to(tl.int64) * heads + head) * num_splits + split
            tl.store(PART_M + row, m_i, mask=mask_g)
            tl.store(PART_L + row, l_i, mask=mask_g)
            tl.store(PART_ACC + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no valid position: zeros
            o_ptrs = OUT + slot.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])

    @triton.jit(do_not_specialize=["span", "nb"])
    def _grouped_kernel(Q, K, V, LENS, OUT, KN, VN, COS, SIN, QW, KW, norm_eps, scale_log2, span, nb,
                        stride_cb, stride_cd, stride_qb, stride_qh, stride_qd,
                        stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
                        stride_kb, stride_kh, stride_ks, stride_kd,
                        stride_vb, stride_vh, stride_vs, stride_vd,
                        stride_ob, stride_oh, stride_od,
                        G: tl.constexpr, P: tl.constexpr, ROWS: tl.constexpr, HEAD_D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, WRITE_NEW: tl.constexpr,
                        ROPE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
        """One (group of ``P`` slots, KV head): the ``P * G`` query rows of the group's slots share one
        ``[ROWS, D]`` tile, and one loop walks the slots' position blocks back to back (slot ``p``'s
        ``ceil(n_p / BLOCK)`` blocks after those of slots ``0 .. p - 1``), so the loads stay pipelined across
        slots instead of restarting per slot. A block belongs to one slot: the other slots' rows score
        ``-inf`` there (their running max and sum stay as they were). Otherwise as :func:`_decode_kernel`
        with one split: each row starts its online softmax from its slot's new key, and the slot's first row
        stores the new K/V before the loop."""
        group = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_r = tl.arange(0, ROWS)
        offs_p = tl.arange(0, P)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK)
        mask_d = offs_d < HEAD_D
        local = offs_r // G  # the row's slot within the group
        row_slot = group * P + local
        row_ok = (offs_r < P * G) & (row_slot < nb)
        head = kvh * G + offs_r % G
        row_slot64 = row_slot.to(tl.int64)
        tile = row_ok[:, None] & mask_d[None, :]
        # first every load the loop does not need (the lengths, this step's own rows), so their latencies overlap
        lens = tl.load(LENS + row_slot, mask=row_ok, other=0).to(tl.int32)
        slot_lens = tl.load(LENS + group * P + offs_p, mask=group * P + offs_p < nb, other=0).to(tl.int32)
        if PDL:  # launched early (programmatic dependent launch): wait for the kernel that wrote q, k_new, v_new
            tl.extra.cuda.gdc_wait()
        q, q_partner = _rows(Q, row_slot64 * stride_qb + head * stride_qh, offs_d, tile, stride_qd, HEAD_D=HEAD_D,
                             ROPE=ROPE)
        if WRITE_NEW:
            k_new, k_partner = _rows(KN, row_slot64 * stride_knb + kvh * stride_knh, offs_d, tile, stride_knd,
                                     HEAD_D=HEAD_D, ROPE=ROPE)
            v_new = tl.load(VN + row_slot64[:, None] * stride_vnb + kvh * stride_vnh + offs_d[None, :] * stride_vnd,
                            mask=tile, other=0.0)
        if ROPE:
            q, k_new = _rope(q, q_partner, k_new, k_partner, COS, SIN, row_slot64 * stride_cb, stride_cd, QW, KW,
                             norm_eps, offs_r, offs_d, tile, HEAD_D=HEAD_D, QK_NORM=QK_NORM)
        lens = tl.minimum(tl.maximum(lens, 0), span)
        # per slot of the group: the cache positions it reads, its blocks, where its blocks start in the loop
        slot_his = tl.minimum(tl.maximum(slot_lens, 0), span)
        if WRITE_NEW:
            slot_his = tl.maximum(slot_his - 1, 0)
        slot_blocks = tl.cdiv(slot_his, BLOCK)
        slot_end = tl.cumsum(slot_blocks, 0)
        slot_start = slot_end - slot_blocks
        k_head = K + kvh.to(tl.int64) * stride_kh
        v_head = V + kvh.to(tl.int64) * stride_vh

        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        if WRITE_NEW:  # each row starts from its slot's new key; the slot's first row stores the new K/V
            has_new = row_ok & (lens >= 1)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
            m_i = tl.where(has_new, s_new, m_i)
            l_i = tl.where(has_new, 1.0, l_i)
            acc = tl.where(has_new[:, None], v_new.to(tl.float32), acc)
            writes = has_new[:, None] & mask_d[None, :] & (offs_r % G == 0)[:, None]
            at = (lens - 1)[:, None]
            tl.store(k_head + row_slot64[:, None] * stride_kb + at * stride_ks + offs_d[None, :] * stride_kd,
                     k_new, mask=writes)
            tl.store(v_head + row_slot64[:, None] * stride_vb + at * stride_vs + offs_d[None, :] * stride_vd,
                     v_new, mask=writes)
        for t in range(0, tl.sum(slot_blocks, 0)):
            p_slot = tl.sum((slot_end <= t).to(tl.int32), 0)  # the slot whose blocks hold step t
            at_slot = offs_p == p_slot
            slot = group * P + p_slot
            hi = tl.sum(tl.where(at_slot, slot_his, 0), 0)
            pos = (t - tl.sum(tl.where(at_slot, slot_start, 0), 0)) * BLOCK + offs_n
            mask_n = pos < hi
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_head + slot.to(tl.int64) * stride_kb + pos[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where((local == p_slot)[:, None] & mask_n[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # rows of other slots: -inf here, so m_i (finite)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + slot.to(tl.int64) * stride_vb + pos[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = OUT + row_slot64[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])

    @triton.jit
    def _merge_kernel(OUT, PART_ACC, PART_M, PART_L, num_splits, stride_ob, stride_oh, stride_od,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """One (slot, query head): combine the chunks' softmax partials into the output row."""
        slot = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < num_splits
        row = (slot.to(tl.int64) * heads + head) * num_splits + offs_s
        m = tl.load(PART_M + row, mask=mask_s, other=-1.0e30)
        l = tl.load(PART_L + row, mask=mask_s, other=0.0)
        acc = tl.load(PART_ACC + row[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # empty chunks hold m = -1e30: weight 0 (or all equal when all empty)
        total = tl.sum(w * l, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        o_ptrs = OUT + slot.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + offs_d * stride_od
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_D)


@functools.lru_cache(maxsize=8)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached); an H200's 132 off CUDA (the Triton interpreter in
    tests), so launch plans there are the ones a GPU would get."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_n(block_d: int, itemsize: int) -> int:
    """Positions per loop iteration: ``BLOCK_N``, fewer where a tile would pass ``TILE_BYTES`` (float32 or
    ``D = 256``), so three pipeline stages of K and V (96 KB) stay well inside shared memory."""
    return max(16, min(BLOCK_N, TILE_BYTES // (block_d * itemsize)))


@functools.lru_cache(maxsize=8)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_supported(device: torch.device) -> bool:
    """Whether the kernels can be launched with programmatic dependent launch on ``device``: CUDA of compute
    capability 9 or newer (Hopper), a Triton with ``launch_pdl`` and ``gdc_wait``, not the interpreter."""
    import os

    if device.type != "cuda" or triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except Exception:  # noqa: BLE001 - an older triton: launch the plain way
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and _cuda_capability(index)[0] >= 9


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan_splits(nb: int, hkv: int, span: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """``(splits, chunk)``: sequence chunks per (slot, KV head) and the positions in each (a multiple of
    ``BLOCK_N``; ``splits * chunk >= span``). A function of shapes only: a CUDA graph replays one plan.

    Default: one chunk when the ``nb * Hkv`` programs fill the GPU's SMs, else enough chunks of at least
    ``MIN_SPLIT_POSITIONS`` for about two programs per SM."""
    if num_splits is None:
        programs = nb * hkv
        sms = sm_count(device)
        if programs >= sms:
            num_splits = 1
        else:
            num_splits = min(_cdiv(2 * sms, programs), _cdiv(span, MIN_SPLIT_POSITIONS), MAX_SPLITS)
    num_splits = max(1, min(int(num_splits), _cdiv(span, BLOCK_N)))
    chunk = max(BLOCK_N, _cdiv(_cdiv(span, num_splits), BLOCK_N) * BLOCK_N)
    return max(1, _cdiv(span, chunk)), chunk


def _plan_group(nb: int, hkv: int, g: int, device: torch.device, slots_per_program: int | None,
                num_splits: int | None) -> int:
    """Slots per program (1: :func:`_decode_kernel`, one program per slot): ``slots_per_program``, a power
    of two with at most ``MAX_GROUP_ROWS`` query rows, halved while the ``ceil(nb / P) * Hkv`` programs would
    not fill the GPU's SMs (small batches split their sequences instead). More than one runs one split, so
    an explicit ``num_splits`` must then be None or 1. None: ``GROUP_SLOTS`` (fewer where ``G`` is large), or
    1 where ``num_splits`` asks for more than one split.
    At the benchmark shape on an H200 (256 slots, 8 KV heads) eight slots a program are the fastest grouping."""
    if slots_per_program is None:  # the default yields to sequence splits asked for
        if num_splits not in (None, 1):
            return 1
        slots_per_program = max(1, min(GROUP_SLOTS, _pow2(MAX_GROUP_ROWS // g + 1) // 2))
    group = int(slots_per_program)
    if group < 1 or group & (group - 1) or group * g > MAX_GROUP_ROWS:
        raise ValueError(f"slots_per_program: expected a power of two with at most {MAX_GROUP_ROWS} query rows "
                         f"({MAX_GROUP_ROWS // g} slots at {g} query heads per KV head), got {slots_per_program}")
    if group > 1 and num_splits not in (None, 1):
        raise ValueError(f"slots_per_program={group} runs one split per slot, got num_splits={num_splits}")
    if num_splits is None:
        while group > 1 and _cdiv(nb, group) * hkv < sm_count(device):
            group //= 2
    return group


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int = 3, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None, slots_per_program: int | None = None,
                     rope: Rope | None = None, pdl: bool = False) -> torch.Tensor:
    """Decode attention with the Triton kernel.

    ``q`` ``[nb, H, D]`` or ``[nb, H, 1, D]``; ``k``/``v`` ``[nb, Hkv, S, D]``, any strides (one layer's
    view of the slot cache, e.g. ``k_cache[l, :nb, :, :span]``: read in place, never copied); ``lengths``
    ``[nb]`` int32/int64 on the device: valid positions per slot (``position + 1``), clamped to ``[0, S]``;
    ``scale`` the softmax scale. Returns the shape of ``q`` in ``q``'s dtype (``out``: an optional
    preallocated ``[nb, H, D]`` tensor to write into). Query head ``h`` attends with KV head
    ``h // (H / Hkv)``. ``num_splits``: sequence chunks per (slot, KV head), default chosen from the
    shapes (1 when ``nb * Hkv`` fills the GPU); ``block_n`` (a power of two >= 16), ``num_warps``,
    ``num_stages``: launch tuning (defaults: 64 positions per iteration for bf16 at ``D <= 128``, three
    pipeline stages: the fastest at the benchmark shape on an H200).
    ``slots_per_program``: slots whose query rows share one program (:func:`_grouped_kernel`: one loop over
    the group's positions, a ``[P * G, D]`` query tile; one split); None: ``GROUP_SLOTS``, as
    :func:`_plan_group` plans it.
    ``k_new``/``v_new`` (``[nb, Hkv, D]`` or ``[nb, Hkv, 1, D]``, any strides): this step's keys and values,
    written into ``k``/``v`` at ``lengths[b] - 1`` by the kernel itself and attended to there (the decode
    step then needs no separate cache write); every ``lengths[b]`` must then be ``<= S`` (not clamped).
    ``rope`` (:class:`Rope`; needs ``k_new``): ``q`` and ``k_new`` are the raw projections, rotated (and
    RMS-normed per head) as each program loads them, and the cache gets the rotated key: the decode step then
    needs no kernel of its own for Qwen3's Q/K norms and the rotary (one launch and a round trip of ``q`` and
    ``k`` fewer per layer).
    ``pdl``: launch with programmatic dependent launch where supported (:func:`pdl_supported`: Hopper or
    newer): the kernel's blocks start while the kernel before it drains and read nothing it writes before
    ``griddepcontrol.wait``, so ``q``, ``k_new``, ``v_new`` may come from the kernel launched just before,
    everything else from kernels before that one. Off by default: after cuBLAS's matmuls it widens the gap
    before the attention on an H200.

    No host synchronization and no allocation but the output (and the split partials): capturable in a
    CUDA graph, and a replay with new ``lengths`` values attends over the new lengths.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs triton; use decode_attention_reference")
    q3, four_d = _as_3d(q)
    nb, heads, hkv, span, d = _check(q3, k, v, lengths)
    out = _checked_out(q3, k, v, lengths, out, nb, heads, span, d)
    if k_new is not None:
        k_new, v_new = _new_rows(k_new, k, "k_new"), _new_rows(v_new, k, "v_new")
    if rope is not None:
        if k_new is None:
            raise ValueError("rope needs k_new: this step's keys are rotated before they are cached")
        rope = _checked_rope(rope, nb, d)
    if nb == 0:
        return out[:, :, None, :] if four_d else out

    g = heads // hkv
    block_d = max(16, _pow2(d))
    block = _block_n(block_d, q3.element_size()) if block_n is None else int(block_n)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block}")
    group = _plan_group(nb, hkv, g, q3.device, slots_per_program, num_splits)
    kn, vn = (q3, q3) if k_new is None else (k_new, v_new)  # unread without WRITE_NEW
    pdl = bool(pdl) and pdl_supported(q3.device)
    common = dict(G=g, HEAD_D=d, BLOCK_D=block_d, BLOCK=block, IEEE=q3.dtype == torch.float32,
                  WRITE_NEW=k_new is not None, ROPE=rope is not None, PDL=pdl,
                  QK_NORM=rope is not None and rope.q_norm is not None, num_warps=num_warps, num_stages=num_stages,
                  **({"launch_pdl": True} if pdl else {}))
    # the operands every kernel takes: tensors, the rotary's (unread without ROPE / QK_NORM), scale, strides
    cos, sin = (q3, q3) if rope is None else (rope.cos, rope.sin)
    qw, kw = (q3, q3) if rope is None or rope.q_norm is None else (rope.q_norm, rope.k_norm)
    rotary = (cos, sin, qw, kw, 1e-6 if rope is None else rope.eps)
    cs_strides = (0, 0) if rope is None else cos.stride()
    strides = (*q3.stride(), *kn.stride(), *vn.stride(), *k.stride(), *v.stride(), *out.stride())
    scale_log2 = float(scale) * math.log2(math.e)
    with torch.cuda.device(q3.device) if q3.is_cuda else contextlib.nullcontext():
        if group > 1:
            _grouped_kernel[(_cdiv(nb, group), hkv)](q3, k, v, lengths, out, kn, vn, *rotary, scale_log2, span, nb,
                                                     *cs_strides, *strides,
                                                     P=group, ROWS=max(MIN_DOT_ROWS, _pow2(group * g)), **common)
        else:
            _launch_split(q3, k, v, lengths, out, (kn, vn, *rotary, scale_log2, span), (*cs_strides, *strides),
                          num_splits, common)
    return out[:, :, None, :] if four_d else out


def _checked_out(q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor | None,
                 nb: int, heads: int, span: int, d: int) -> torch.Tensor:
    """:func:`decode_attention`'s checks of devices, dtypes and int32 in-slot offsets; its output ``[nb, H, D]``
    (``out``, checked, or a new tensor)."""
    if not (q3.device == k.device == v.device == lengths.device):
        raise ValueError("q, k, v and lengths must be on one device")
    if k.dtype != q3.dtype or v.dtype != q3.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q3.dtype}, {k.dtype}, {v.dtype}")
    for t, name in ((k, "k"), (v, "v")):  # in-slot offsets stay in int32 (the slot/head bases are int64)
        if span and (span - 1) * t.stride(2) + (d - 1) * t.stride(3) > _INT32_MAX:
            raise ValueError(f"{name}: one (slot, head) spans more than 2**31 elements")
    if out is None:
        return torch.empty((nb, heads, d), dtype=q3.dtype, device=q3.device)
    if out.shape != (nb, heads, d) or out.dtype != q3.dtype:
        raise ValueError(f"out: expected {q3.dtype} [{nb}, {heads}, {d}], got {out.dtype} {tuple(out.shape)}")
    return out


def _launch_split(q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                  operands: tuple, strides: tuple, num_splits: int | None, common: dict) -> None:
    """One program per (slot, KV head, sequence chunk): :func:`_decode_kernel` over ``_plan_splits``'s chunks,
    then, with more than one chunk, :func:`_merge_kernel` over their float32 partials ``[nb, H, splits]`` (max,
    sum) and ``[nb, H, splits, BLOCK_D]`` (accumulator). ``operands``: ``(k_new, v_new, *rotary, scale_log2,
    span)``; ``strides``: the rotary's, then every tensor's."""
    nb, heads, d = out.shape
    hkv, span, g, block_d = k.shape[1], operands[-1], common["G"], common["BLOCK_D"]
    splits, chunk = _plan_splits(nb, hkv, span, q3.device, num_splits)
    if splits > 1:
        part_acc = torch.empty((nb, heads, splits, block_d), dtype=torch.float32, device=q3.device)
        part_m = torch.empty((nb, heads, splits), dtype=torch.float32, device=q3.device)
        part_l = torch.empty((nb, heads, splits), dtype=torch.float32, device=q3.device)
    else:  # unused by the single-pass kernel: any float32 tensors
        part_acc = part_m = part_l = out
    _decode_kernel[(nb, hkv, splits)](q3, k, v, lengths, out, part_acc, part_m, part_l, *operands, chunk, *strides,
                                      G_PAD=max(MIN_DOT_ROWS, _pow2(g)), SPLIT=splits > 1, **common)
    if splits > 1:
        _merge_kernel[(nb, heads)](out, part_acc, part_m, part_l, splits, *out.stride(),
                                   HEAD_D=d, BLOCK_D=block_d, SPLITS_PAD=max(2, _pow2(splits)), num_warps=4)
