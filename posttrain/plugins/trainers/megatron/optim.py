"""Helpers around torch's Adam(W) as Megatron-core uses it without Transformer Engine or Apex."""

from __future__ import annotations

from typing import Any

import torch


def use_fused_adam(optimizer: Any) -> int:
    """Switch the torch ``AdamW`` inside a Megatron optimizer to its fused CUDA kernel; returns how many
    param groups switched. Without TE or Apex, Megatron falls back to torch's AdamW with the default
    (foreach) implementation: one fused kernel per step instead of a few per parameter list."""
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    switched = 0
    for opt in inner:
        if type(opt) is torch.optim.AdamW:
            for group in opt.param_groups:
                group["fused"], group["foreach"] = True, False
                switched += 1
            opt.defaults["fused"], opt.defaults["foreach"] = True, False
    return switched


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch Adam(W) a zero state (as before its first step), so saved and
    loading checkpoint structures agree; the fused kernel keeps its step counter on the parameter's device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                device = p.device if group.get("fused") or group.get("capturable") else "cpu"
                optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=device),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``amp_C.multi_tensor_l2norm``'s contract with torch's foreach kernels: ``sqrt(sum_i ||t_i||^2)``
    over ``tensor_lists[0]`` as a ``[1]`` fp32 tensor on the tensors' device (and the per-tensor norms
    when ``per_tensor``). Megatron's own fallback takes one norm and one host sync per tensor."""
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                  scale: float) -> None:
    """``amp_C.multi_tensor_scale``'s contract with torch's foreach kernels: ``dst_i = src_i * scale``
    (a cast where the dtypes differ; in place when ``dst`` is ``src``). Megatron's own fallback runs two
    kernels per tensor."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        if scale != 1.0:
            torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def foreach_copy_this_to_that(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf: Any = None) -> None:
    """``that_i = this_i`` (a cast where the dtypes differ) in one foreach call: Megatron's bf16 optimizer
    copies its fp32 main parameters into the bf16 model one ``copy_`` per parameter."""
    if this:
        torch._foreach_copy_(that, this)


def use_foreach_multi_tensor() -> bool:
    """Bind Megatron's optimizer and grad-clipping multi-tensor ops to :func:`foreach_l2_norm`,
    :func:`foreach_scale` and :func:`foreach_copy_this_to_that` where Megatron fell back to its per-tensor loops (no Apex, no TE); returns
    whether anything was bound. A MoE layer's experts are hundreds of parameters, so the loops cost a
    launch (and, for the norm, a host sync) per parameter per step."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer

    bound = False
    if getattr(clip_grads, "l2_norm_impl", None) is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl, bound = foreach_l2_norm, True
    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl, bound = foreach_scale, True
    if optimizer.multi_tensor_scale_impl is foreach_scale and \
            optimizer._multi_tensor_copy_this_to_that is not foreach_copy_this_to_that:
        optimizer._multi_tensor_copy_this_to_that, bound = foreach_copy_this_to_that, True
    return bound
