"""The decode attention of ``decode_kernel`` in plain torch, float32 math: the reference its Triton kernels are
tested against and the path where Triton or CUDA is missing (the CPU), with the checks both share and
:class:`Rope`, what the attention applies to raw projections before it attends.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _as_3d(q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``[nb, H, D]`` or ``[nb, H, 1, D]`` -> ``[nb, H, D]`` (a view) and whether it was 4-D."""
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"decode attention takes one query token per slot, got q of shape {tuple(q.shape)}")
        return q[:, :, 0], True
    if q.dim() != 3:
        raise ValueError(f"q: expected [nb, H, D] or [nb, H, 1, D], got shape {tuple(q.shape)}")
    return q, False


def _check(q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> tuple[int, int, int, int, int]:
    nb, heads, d = q3.shape
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes [nb, Hkv, S, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != nb or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q3.shape)} (slots, head dim)")
    hkv = k.shape[1]
    if heads % hkv:
        raise ValueError(f"{heads} query heads are not a multiple of {hkv} KV heads")
    if lengths.shape != (nb,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths: expected int32/int64 of shape [{nb}], got {lengths.dtype} {tuple(lengths.shape)}")
    return nb, heads, hkv, k.shape[2], d


class Rope(NamedTuple):
    """What :func:`decode_attention` applies to raw projections before it attends (``rope=``): each query
    row and this step's key, ``x`` ``[D]``, becomes ``x * cos + rotate_half(x) * sin`` (HF's rotary over the
    whole head, ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``), after ``x * rsqrt(mean(x^2) + eps)`` rounded
    to the input dtype and times the norm's weight (Qwen3's per-head Q/K RMSNorm) when ``q_norm``/``k_norm``
    (``[D]``, both or neither) are given. ``cos``/``sin``: ``[nb, D]`` or ``[nb, 1, D]``, each slot's own."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


def _checked_rope(rope: Rope, nb: int, d: int) -> Rope:
    """``rope`` with ``cos``/``sin`` as ``[nb, D]`` of equal strides, or a ValueError naming what is off."""
    cos, sin = rope.cos.reshape(-1, rope.cos.shape[-1]), rope.sin.reshape(-1, rope.sin.shape[-1])
    if cos.shape != (nb, d) or sin.shape != (nb, d):
        raise ValueError(f"rope: cos and sin must be [{nb}, {d}] (one row per slot), got {tuple(rope.cos.shape)} "
                         f"and {tuple(rope.sin.shape)}")
    if d % 2:
        raise ValueError(f"rope: the head dim must be even, got {d}")
    if (rope.q_norm is None) != (rope.k_norm is None):
        raise ValueError("rope: q_norm and k_norm go together")
    for w in (rope.q_norm, rope.k_norm):
        if w is not None and w.shape != (d,):
            raise ValueError(f"rope: a norm weight must be [{d}], got {tuple(w.shape)}")
    if cos.stride() != sin.stride():  # the kernel walks both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    norms = [None if w is None else w.contiguous() for w in (rope.q_norm, rope.k_norm)]
    return Rope(cos, sin, *norms, float(rope.eps))


def rotate_reference(x: torch.Tensor, rope: Rope, weight: torch.Tensor | None) -> torch.Tensor:
    """:class:`Rope`'s rotation of ``x`` ``[nb, h, D]`` (with the norm ``weight`` or none) in plain torch,
    float32 math, the result in ``x``'s dtype."""
    nb, _, d = x.shape
    xf = x.float()
    if weight is not None:
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rope.eps)).to(x.dtype).float() * weight.float()
    cos, sin = rope.cos.reshape(nb, 1, d).float(), rope.sin.reshape(nb, 1, d).float()
    half = d // 2
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], -1) * sin).to(x.dtype)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                               scale: float, k_new: torch.Tensor | None = None,
                               v_new: torch.Tensor | None = None, rope: Rope | None = None) -> torch.Tensor:
    """:func:`decode_attention` in plain torch, same semantics: ``q`` ``[nb, H, D]`` or ``[nb, H, 1, D]``,
    ``k``/``v`` ``[nb, Hkv, S, D]``, ``lengths`` ``[nb]`` -> the shape of ``q`` in ``q``'s dtype;
    ``k_new``/``v_new`` (``[nb, Hkv, D]`` or ``[nb, Hkv, 1, D]``) are first written at ``lengths - 1``;
    ``rope`` (:class:`Rope`, needs ``k_new``): ``q`` and ``k_new`` are raw, rotated (and normed) first.

    Scores, softmax and the weighted sum run in float32 over the whole span with positions
    ``>= lengths[b]`` masked out; a row with no valid position gives zeros."""
    q3, four_d = _as_3d(q)
    nb, heads, hkv, span, d = _check(q3, k, v, lengths)
    if rope is not None:
        if k_new is None:
            raise ValueError("rope needs k_new: this step's keys are rotated before they are cached")
        rope = _checked_rope(rope, nb, d)
        q3 = rotate_reference(q3, rope, rope.q_norm)
        k_new = rotate_reference(_new_rows(k_new, k, "k_new"), rope, rope.k_norm)
    if k_new is not None:
        _write_newest(k, v, _new_rows(k_new, k, "k_new"), _new_rows(v_new, k, "v_new"), lengths)
    qg = q3.reshape(nb, hkv, heads // hkv, d).float()
    scores = torch.einsum("bjgd,bjsd->bjgs", qg, k.float()) * scale
    valid = torch.arange(span, device=k.device)[None, :] < lengths[:, None]  # [nb, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp_min(-1e30)  # finite even for a row with nothing valid
    weights = torch.exp(scores - top)
    probs = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)  # all-masked rows: 0 / tiny = 0
    out = torch.einsum("bjgs,bjsd->bjgd", probs, v.float()).reshape(nb, heads, d).to(q.dtype)
    return out[:, :, None, :] if four_d else out


def _new_rows(x: torch.Tensor | None, k: torch.Tensor, name: str) -> torch.Tensor:
    """``k_new``/``v_new`` as ``[nb, Hkv, D]`` (a view), checked against the cache view ``k``."""
    if x is None:
        raise ValueError("k_new and v_new go together")
    if x.dim() == 4 and x.shape[2] == 1:
        x = x[:, :, 0]
    if x.shape != (k.shape[0], k.shape[1], k.shape[3]) or x.dtype != k.dtype:
        raise ValueError(f"{name}: expected {k.dtype} [{k.shape[0]}, {k.shape[1]}, {k.shape[3]}], "
                         f"got {x.dtype} {tuple(x.shape)}")
    return x


def _write_newest(k, v, k_new, v_new, lengths) -> None:
    """``k[b, :, lengths[b] - 1] = k_new[b]`` (and ``v``) for every slot with ``1 <= lengths[b] <= S``."""
    rows = torch.arange(k.shape[0], device=k.device)
    valid = (lengths >= 1) & (lengths <= k.shape[2])
    at = (lengths - 1).clamp(0, k.shape[2] - 1)
    k[rows[valid], :, at[valid]] = k_new[valid]
    v[rows[valid], :, at[valid]] = v_new[valid]
