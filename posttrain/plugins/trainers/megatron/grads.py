"""Gradient reductions of the CPU path (torch AdamW; on GPU Megatron's ``finalize_model_grads`` and
optimizer do the same): DP all-reduce, TP sums of partial grads, tied embeddings across PP stages, and
the global L2 norm that clipping uses."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from posttrain.plugins.trainers.megatron import model as M


def dp_sum(value: float, device: Any) -> float:
    """``value`` summed over the data-parallel ranks."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return float(t.item())


def _expert_parallel(p: Any) -> bool:
    """A routed expert's parameter under EP > 1 (Megatron marks them ``allreduce=False``): each EP rank
    holds other experts, replicated only over the expert-data-parallel ranks."""
    return not getattr(p, "allreduce", True)


def dp_all_reduce(params: list[torch.nn.Parameter]) -> None:
    """Sum every gradient over the data-parallel ranks (losses are already normalized by global counts);
    expert-parallel experts over the expert-data-parallel ranks (their tokens from every DP rank already
    reached them through the token dispatcher, whose backward brought those gradients back)."""
    from megatron.core import parallel_state

    groups = {False: (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_group()),
              True: (parallel_state.get_expert_data_parallel_world_size(),
                     parallel_state.get_expert_data_parallel_group())}
    for p in params:
        size, group = groups[_expert_parallel(p)]
        if p.grad is not None and size > 1:
            dist.all_reduce(p.grad, group=group)


def tp_sum_partial(gpt: Any, tp_size: int) -> None:
    """Replicated parameters that each TP rank applies to its own heads only (per-head q/k norms) get a
    partial gradient per rank: sum them, as Megatron's ``finalize_model_grads`` does."""
    from megatron.core import parallel_state

    if tp_size == 1:
        return
    for name, p in gpt.named_parameters():
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


def sum_tied_embedding(gpt: Any, tied: bool) -> None:
    """With PP and tied embeddings the first and last stage each hold a copy: sum their gradients."""
    from megatron.core import parallel_state

    if M.pp_size() == 1 or not tied or not parallel_state.is_rank_in_embedding_group():
        return
    weight = gpt.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def global_norm(params: list[torch.nn.Parameter], tp_size: int) -> float:
    """Global L2 norm: TP-sharded grads summed over TP ranks, replicated ones counted once, expert-parallel
    experts summed over the expert TP x EP ranks, PP stages added."""
    from megatron.core import parallel_state

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    experts = torch.zeros((), dtype=torch.float64)
    last_stage_copy = M.pp_size() > 1 and not parallel_state.is_pipeline_first_stage()
    for p in params:
        if p.grad is None or (last_stage_copy and getattr(p, "shared_embedding", False)):
            continue  # a tied output layer's grad equals the embedding's: count it once
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if _expert_parallel(p):
            experts += sq
        elif getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if tp_size > 1:
        dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=parallel_state.get_expert_tensor_and_model_parallel_group())
    total = sharded + replicated + experts
    if M.pp_size() > 1:  # each stage holds different parameters
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return float(total.sqrt())
