"""The decode step's attention over the slot KV cache, one query token per slot (``ModelRunner``'s
``decode_attention``): ``sdpa``, ``bmm`` or ``triton`` (``decode_kernel``).

:func:`step_attention` builds the step's ``attend(l, q, k, v)`` once for all layers: it writes the step's
keys and values into layer ``l``'s cache at each slot's position (the Triton kernel does that itself) and
attends over the cache. ``sdpa`` and ``bmm`` read a span shared by the batch
and mask each row's tail; ``triton`` reads each slot's own ``position + 1`` entries. All three compute
the same attention to float32 rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def step_attention(runner, positions: torch.Tensor, span: int, tables: tuple | None = None):
    """``attend(l, q [nb, H, 1, D], k, v [nb, Hkv, 1, D]) -> [nb, H, 1, D]`` for one decode step of
    ``runner`` (a ``ModelRunner``: its cache, attention kind and scale) at ``positions`` ``[nb]``, over the
    cache's first ``span`` positions; a mask, where one is needed, is built once for all layers. With the
    runner's ``rope_in_attention``, ``q`` and ``k`` are raw projections and ``tables`` the step's rotary
    ``(cos, sin)`` (``[nb, 1, D]`` each): the Triton kernel norms and rotates them (``decode_kernel.Rope``)."""
    nb = positions.shape[0]
    k_cache, v_cache, scale = runner.k_cache, runner.v_cache, runner.scaling
    caches = lambda l: (k_cache[l, :nb, :, :span], v_cache[l, :nb, :, :span])  # noqa: E731
    if runner.decode_attention == "triton":  # no mask: each slot reads its own ``position + 1`` entries
        lengths = positions + 1
        kernel = triton_attention(positions.is_cuda, runner.attention_launch)
        if runner.rope_in_attention:
            ropes = layer_ropes(runner.layers, *tables)
            return lambda l, q, k, v: kernel(q, *caches(l), lengths, scale, k_new=k, v_new=v, rope=ropes[l])
        # the kernel writes k, v at ``position`` itself: two cache-write launches a layer fewer
        return lambda l, q, k, v: kernel(q, *caches(l), lengths, scale, k_new=k, v_new=v)
    past = torch.arange(span, device=positions.device)[None, :] > positions[:, None]  # [nb, span]: masked out
    if runner.decode_attention == "bmm":
        masked, fp32 = past[:, None, :], bmm_fp32_out_supported(positions.device, k_cache.dtype)
        attend = lambda q, kc, vc: attend_bmm(q, kc, vc, masked, scale, fp32)  # noqa: E731
    else:
        allowed = ~past[:, None, None, :]
        attend = lambda q, kc, vc: attend_sdpa(q, kc, vc, allowed, scale)  # noqa: E731
    rows = torch.arange(nb, device=positions.device)

    def write_then_attend(l, q, k, v):
        k_cache[l][rows, :, positions] = k[:, :, 0]
        v_cache[l][rows, :, positions] = v[:, :, 0]
        return attend(q, *caches(l))

    return write_then_attend


def layer_ropes(layers, cos: torch.Tensor, sin: torch.Tensor) -> list:
    """One ``decode_kernel.Rope`` per layer: the step's ``cos``/``sin`` and the layer's Q/K norm weights (found
    again at every step: a memory release may have moved them; None for a model without Q/K norms)."""
    from posttrain.plugins.engines.local.decode_kernel import Rope
    from posttrain.plugins.engines.local.layers import norm_epsilon

    out = []
    for layer in layers:
        attn = layer.self_attn
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None:
            out.append(Rope(cos, sin))
        else:
            out.append(Rope(cos, sin, q_norm.weight, k_norm.weight, norm_epsilon(q_norm)))
    return out


def attend_sdpa(q, k, v, allowed, scale: float):
    """SDPA with one query token per slot. ``q`` ``[nb, H, 1, D]``, ``k``/``v`` ``[nb, Hkv, span, D]``,
    ``allowed`` ``[nb, 1, 1, span]`` bool -> ``[nb, H, 1, D]``.

    GQA: the ``G = H / Hkv`` query heads sharing a KV head become ``G`` query rows of that head
    (``[nb, Hkv, G, D]``), so the kernel reads each cached K/V once instead of expanding it."""
    nb, heads, _, d = q.shape
    hkv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(nb, hkv, heads // hkv, d), k, v, attn_mask=allowed, scale=scale)
    return o.reshape(nb, heads, 1, d)


def attend_bmm(q, k, v, masked, scale: float, fp32_scores: bool = False):
    """The same attention as two batched matmuls. ``q`` ``[nb, H, 1, D]``, ``k``/``v``
    ``[nb, Hkv, span, D]`` (strided views of the cache), ``masked`` ``[nb, 1, span]`` bool (True past
    the slot's position) -> ``[nb, H, 1, D]``.

    ``scores = q_g @ K^T`` over ``[nb*Hkv, G, D] x [nb*Hkv, D, span]`` (the cache views merge ``nb`` and
    ``Hkv`` without a copy), scaled and masked in float32, softmax in float32, cast back to the cache dtype
    for ``@ V``. ``fp32_scores``: the first matmul writes float32 (:func:`bmm_fp32_out_supported`)."""
    nb, heads, _, d = q.shape
    hkv, span = k.shape[1], k.shape[2]
    g = heads // hkv
    qg = q.reshape(nb * hkv, g, d)
    kt = k.reshape(nb * hkv, span, d).transpose(1, 2)
    if fp32_scores:  # bf16 inputs, float32 accumulator written out as float32
        scores = torch.bmm(qg, kt, out_dtype=torch.float32)
    else:
        scores = torch.bmm(qg, kt).float()
    scores = scores.view(nb, hkv * g, span).mul_(scale).masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(nb * hkv, g, span)
    o = torch.bmm(probs, v.reshape(nb * hkv, span, d))
    return o.view(nb, heads, 1, d)


# decode_kernel.decode_attention's launch settings
LAUNCH_KEYS = ("block_n", "num_warps", "num_stages", "num_splits", "slots_per_program", "pdl")


def checked_launch(launch: dict | None) -> dict:
    """Launch settings of the Triton decode attention (keys among ``LAUNCH_KEYS``), or a ValueError naming
    the unknown ones."""
    unknown = sorted(set(launch or {}) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"attention_launch: unknown keys {unknown}; valid: {', '.join(LAUNCH_KEYS)}")
    return dict(launch or {})


def triton_attention(on_cuda: bool, launch: dict | None = None):
    """The Triton flash-decoding kernel (``decode_kernel.decode_attention``, with the ``launch`` settings:
    ``block_n``, ``num_warps``, ``num_stages``, ``num_splits``, ``slots_per_program``), called as
    ``attend(q [nb, H, 1, D], k/v [nb, Hkv, span, D] (strided cache views), lengths [nb], scale)
    -> [nb, H, 1, D]``; each slot reads only its own ``lengths[i] = position + 1`` cache entries. Without
    CUDA or triton, the same attention in plain torch (``decode_attention_reference``; launch settings do
    not apply)."""
    from posttrain.plugins.engines.local.decode_kernel import (decode_attention, decode_attention_reference,
                                                               triton_available)

    if not (on_cuda and triton_available()):
        return decode_attention_reference
    return functools.partial(decode_attention, **launch) if launch else decode_attention


_FP32_OUT: dict[tuple[str, torch.dtype], bool] = {}


def bmm_fp32_out_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` works here for ``dtype`` inputs (CUDA
    half/bf16 only): scores then leave the matmul in float32 instead of being rounded to bf16. Probed
    once per device type and dtype."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    key = (device.type, dtype)
    if key not in _FP32_OUT:
        try:
            a = torch.zeros((1, 2, 8), dtype=dtype, device=device)
            _FP32_OUT[key] = torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[key] = False
    return _FP32_OUT[key]
