"""Data parallelism of :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer`: every rank of
a trainer group is handed the whole batch; each data-parallel (DP) replica takes its share, balanced by
token count, and the shares' results are gathered back in sample order, so every rank returns what one
trainer returns. Functions of the trainer's batches, kept apart so the trainer class stays readable.

Shares: :func:`split_by_tokens` over ``batch.lengths`` (tokens per sample, prompt + response: the work
a sample costs). Losses are normalized by the step's global token and sample counts (``_dp_sum``) and
gradients summed over DP (``grads.dp_all_reduce`` on CPU, Megatron's DDP on GPUs), so a step at DP=2
equals the step at DP=1 up to float summation order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.train_batch import split_by_tokens


def dp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def share(batch: Any) -> tuple[Any, list[int] | None]:
    """``(this replica's share of batch, its sample indices)``; ``(batch, None)`` without DP."""
    rank, size = dp_rank_size()
    if size == 1:
        return batch, None
    index = split_by_tokens(batch.lengths.tolist(), size)[rank]
    return batch.take(index), index


def gather(results: tuple[torch.Tensor | None, ...], index: list[int] | None, batch: Any) -> tuple:
    """Every share's ``[b, t]`` results (CPU) back into ``[B, T]`` of ``batch``, in sample order, on every
    rank (a collective over the DP group). ``None`` entries stay None."""
    if index is None:
        return results
    from megatron.core import parallel_state

    parts: list[Any] = [None] * dp_rank_size()[1]
    dist.all_gather_object(parts, (index, results), group=parallel_state.get_data_parallel_group())
    width = batch.tokens.shape[1]
    out = []
    for k, first in enumerate(results):
        if first is None:
            out.append(None)
            continue
        merged = first.new_zeros(len(batch), width)
        for rows, values in parts:
            merged[rows, : values[k].shape[1]] = values[k]
        out.append(merged)
    return tuple(out)


def reduce_metrics(totals: dict[str, float], seqs: int, global_seqs: float, summed: set[str]) -> dict[str, float]:
    """The whole step's metrics from every DP rank's: ``loss`` and the ``summed`` ones are this rank's
    share of the batch value (normalized by global counts) and add up; the others are means over this
    rank's ``seqs`` samples, weighted by ``seqs / global_seqs``. Every rank returns the same."""
    from megatron.core import parallel_state

    if dp_rank_size()[1] == 1:
        return totals
    parts: list[Any] = [None] * dp_rank_size()[1]
    dist.all_gather_object(parts, (seqs, totals), group=parallel_state.get_data_parallel_group())
    out: dict[str, float] = {}
    for n, metrics in parts:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + (v if k == "loss" or k in summed else v * n / global_seqs)
    return out
