"""Tensor-parallel sharding of full (HF-layout) tensors into a rank's Megatron parameters, and back.

A parameter Megatron marks ``tensor_model_parallel`` is split along its ``partition_dim`` over its TP
group (routed experts: the expert-TP group). A gated MLP's ``linear_fc1`` holds ``[gate; up]``; each half
is split on its own, so rank ``r`` holds ``[gate_r; up_r]``, which is what Megatron's MLP chunks in two.
Used by model building, seeded initialization and HF loading/export alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def tp_info() -> tuple[int, int]:
    """``(tensor-parallel rank, size)``."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def ep_info() -> tuple[int, int]:
    """``(expert-parallel rank, size)``."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def is_expert(name: str) -> bool:
    """A routed expert's parameter (sharded over EP, and over the expert-TP group instead of TP)."""
    return ".mlp.experts." in name


def tp_group_of(name: str) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of the tensor-parallel group that splits parameter ``name``."""
    from megatron.core import parallel_state

    if is_expert(name):
        return (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_group())
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _is_gated_fc1(name: str, param: Any) -> bool:
    """A gated MLP's ``[gate; up]`` (dense, routed-expert or shared-expert ``linear_fc1``), TP-split."""
    return name.endswith("linear_fc1.weight") and ".mlp." in f".{name}" and getattr(param, "tensor_model_parallel", False)


def shard(name: str, param: Any, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's piece of the unsharded tensor ``full`` for parameter ``param``."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if _is_gated_fc1(name, param):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def gather(name: str, param: Any) -> torch.Tensor:
    """The unsharded tensor of ``param`` (all-gathered over its TP group when it is split), detached."""
    _, tp, group = tp_group_of(name)
    local = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _is_gated_fc1(name, param):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=param.partition_dim)


def mark_tp_params(model: Any) -> None:
    """Set ``tensor_model_parallel``/``partition_dim`` on every TP-split parameter.

    Megatron 0.16 sets them only when it initializes the weights itself (``perform_initialization``);
    weights loaded from a checkpoint would otherwise look replicated to sharding, gathering and the
    grad norm. Expert linears are split over the expert-TP group: left unmarked when it has one rank.
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, RowParallelLinear):
            dims = {"weight": 1}  # its bias is added after the all-reduce: replicated
        else:
            continue
        group = getattr(module, "tp_group", None)
        if getattr(module, "is_expert", False) and group is not None and dist.get_world_size(group) == 1:
            continue
        for attr, dim in dims.items():
            param = getattr(module, attr, None)
            if isinstance(param, torch.nn.Parameter) and not hasattr(param, "partition_dim"):
                set_tensor_model_parallel_attributes(param, True, dim, 1)
