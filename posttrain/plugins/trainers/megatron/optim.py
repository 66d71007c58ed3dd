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
