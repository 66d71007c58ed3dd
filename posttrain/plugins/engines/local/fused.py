"""Fused projections for the local engine: one matmul for a layer's Q/K/V and one for its SwiGLU gate/up.

At the decode batch sizes (``M`` = 256 rows on an H200, Qwen3-1.7B shape) three thin matmuls cost more
than one wide one: fused, Q/K/V take about half the time and gate/up a sixth less
(``bench/decode_parts.py --gemms``). The modules keep their own ``weight`` parameters, so names, checkpoints,
weight updates and checksums see nothing new: :func:`fuse_rows` only moves each group's weights (and
biases) into row blocks of one tensor, back to back, and makes every module's parameter a view of its
block. :func:`layer_parts` finds such a group again at each forward (the weights are never copied), and
returns None where the blocks no longer sit back to back (a memory release on the plain path puts each
parameter in a storage of its own): the layer then runs its modules one by one, as before fusing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class Fused(NamedTuple):
    """A group of projections run as one matmul: ``weight`` ``[sum(sizes), in]``, ``bias`` ``[sum(sizes)]``
    or None; ``sizes`` the output width of each module, in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


def run_fused(fused: Fused, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x`` ``[..., in]`` -> one ``[..., size]`` view per module (splits of one matmul's output)."""
    return F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)


def _linear_groups(layer) -> list[list[Any]]:
    """The projection groups of a decoder layer that can run as one matmul: Q/K/V, and the dense SwiGLU
    MLP's gate/up (GLM-4's dense MLP is fused already; MoE blocks are left alone)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = []
    if all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
        groups.append([attn.q_proj, attn.k_proj, attn.v_proj])
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not hasattr(mlp, "experts"):
        groups.append([mlp.gate_proj, mlp.up_proj])
    return groups


@torch.no_grad()
def fuse_rows(linears: list[Any]) -> bool:
    """Lay ``linears``' weights (``[out_i, in]``) out as row blocks of one ``[sum out_i, in]`` tensor, each
    module's weight a view of its block; biases the same way. False (nothing changed) when some have a
    bias and others not, or the input widths or dtypes differ."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return False
    for params in (weights, biases):
        if params[0] is None:
            continue
        block = torch.cat([p.data for p in params])
        at = 0
        for p in params:
            p.data = block[at: at + p.shape[0]]  # the old storage is freed with its last reference
            at += p.shape[0]
    return True


def fuse_layers(layers) -> int:
    """:func:`fuse_rows` every group of every layer; returns how many groups were fused."""
    return sum(fuse_rows(group) for layer in layers for group in _linear_groups(layer))


def _stacked(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The tensor whose row blocks are ``tensors`` (contiguous, in one storage, back to back), or None."""
    first = tensors[0]
    if first is None:
        return None
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if t is None or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.data_ptr() != at:
            return None
        at += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride())


def group_parts(linears: list[Any]) -> Fused | None:
    """The :class:`Fused` matmul of ``linears`` when :func:`fuse_rows` laid them out and they still are."""
    weight = _stacked([m.weight for m in linears])
    if weight is None:
        return None
    bias = None
    if linears[0].bias is not None:
        bias = _stacked([m.bias for m in linears])
        if bias is None:
            return None
    return Fused(weight, bias, tuple(m.weight.shape[0] for m in linears))


def layer_parts(layer) -> tuple[Fused | None, Fused | None]:
    """``(qkv, gate_up)`` of a decoder layer, each a :class:`Fused` or None (run the modules one by one)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = group_parts([attn.q_proj, attn.k_proj, attn.v_proj]) if hasattr(attn, "q_proj") else None
    gate_up = None
    if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") and not hasattr(mlp, "experts"):
        gate_up = group_parts([mlp.gate_proj, mlp.up_proj])
    return qkv, gate_up
