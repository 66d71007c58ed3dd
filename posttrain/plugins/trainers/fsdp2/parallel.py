"""Data parallelism of the ``fsdp2`` trainer: the process group, each rank's share, its micro-batches.

FSDP2 shards every parameter over the trainer group's ``W`` ranks, and every forward all-gathers each
layer's weights from all of them: every rank must run the same number of forward (and backward) passes.
So each rank takes its share of the batch (:func:`split_by_tokens` over the samples' token counts),
the ranks agree on one micro-batch count ``K`` (the largest any rank needs: ``ceil(n / micro_batch_size)``,
or by tokens what ``max_tokens_per_micro_batch`` allows), and each rank splits its share into ``K``
token-balanced micro-batches; a rank with fewer than ``K`` samples runs its extra passes on its first
sample with the loss multiplied by 0 (:func:`micro_batches` marks them).

By tokens, a micro-batch costs what it computes: ``count x longest`` in padded rows, ``sum(lengths)`` packed.
Packed, no micro-batch exceeds ``max_tokens`` unless it is one sample longer than that (as the Megatron
backend's): a rank needs the fewest ``k`` whose longest-first balanced split (:func:`split_by_tokens`) keeps
every share of several samples within it (:func:`capped_split`).
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.train_batch import TrainBatch, split_by_tokens


def init_group() -> None:
    """torch.distributed from the trainer group's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), else a one-rank group on a free loopback port; NCCL on GPUs, Gloo on the CPU."""
    if dist.is_initialized():
        return
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "MASTER_ADDR" in os.environ:
        init = "env://"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=init, rank=rank,
                            world_size=world)


def rank_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def share(batch: TrainBatch) -> tuple[TrainBatch, list[int] | None]:
    """``(this rank's samples of batch, their indices)``; ``(batch, None)`` on one rank."""
    rank, size = rank_size()
    if size == 1:
        return batch, None
    index = split_by_tokens(batch.lengths.tolist(), size)[rank]
    return batch.take(index), index


def all_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_sum(value: float, device: torch.device) -> float:
    """``value`` summed over the ranks (the step's global token or sample count)."""
    if rank_size()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def micro_batches(part: TrainBatch, size: int, max_tokens: int | None, packed: bool = False,
                  ) -> list[tuple[list[int], bool]]:
    """``[(sample indices of part, is_real)]``: ``K`` micro-batches, the same ``K`` on every rank, each
    token-balanced within ``part`` (``size``: samples per micro-batch; ``max_tokens``: tokens per
    micro-batch instead, counted as ``packed`` rows or padded ones). Extra passes (``is_real`` False) rerun
    sample 0."""
    n, lengths = len(part), part.lengths.tolist()
    if max_tokens and packed:
        local = capped_split(lengths, max_tokens)
        want = len(local)
    elif max_tokens:
        want = math.ceil(n * max(lengths) / max_tokens)
    else:
        want = math.ceil(n / size)
    k = all_max(max(1, want)) if rank_size()[1] > 1 else max(1, want)
    if max_tokens and packed:
        shares = _capped(lengths, min(k, n), max_tokens) or _split_largest(local, lengths, min(k, n))
    else:
        shares = split_by_tokens(lengths, min(k, n))
    return [(index, True) for index in shares] + [([0], False)] * (k - len(shares))


def capped_split(lengths: list[int], cap: int) -> list[list[int]]:
    """The fewest balanced shares (:func:`split_by_tokens`; from one per sample longer than ``cap`` plus
    ``ceil(rest / cap)`` up) with no share of several samples above ``cap`` tokens (at ``len(lengths)`` shares
    each holds one sample)."""
    long = [n for n in lengths if n > cap]
    k = max(1, len(long) + math.ceil((sum(lengths) - sum(long)) / cap))
    while (shares := _capped(lengths, min(k, len(lengths)), cap)) is None:
        k += 1
    return shares


def _capped(lengths: list[int], k: int, cap: int) -> list[list[int]] | None:
    shares = split_by_tokens(lengths, k)
    ok = all(len(s) == 1 or sum(lengths[i] for i in s) <= cap for s in shares)
    return shares if ok else None


def _split_largest(shares: list[list[int]], lengths: list[int], k: int) -> list[list[int]]:
    """``shares`` (each within the cap) grown to ``k`` by halving the largest of several samples in turn (the
    halves stay within it); fewer when every share is one sample."""
    shares = [list(s) for s in shares]
    while len(shares) < k:
        several = [s for s in shares if len(s) > 1]
        if not several:
            break
        big = max(several, key=lambda s: sum(lengths[i] for i in s))
        shares.remove(big)
        shares += [[big[i] for i in half] for half in split_by_tokens([lengths[i] for i in big], 2)]
    return shares


def gather(results: tuple[torch.Tensor | None, ...], index: list[int] | None, batch: TrainBatch) -> tuple:
    """Every rank's ``[b, t]`` results (CPU) back into ``[B, T]`` of ``batch`` in sample order, on every
    rank (a collective). ``None`` entries stay None."""
    if index is None:
        return results
    parts: list[Any] = [None] * rank_size()[1]
    dist.all_gather_object(parts, (index, results))
    out = []
    for k, first in enumerate(results):
        if first is None:
            out.append(None)
            continue
        merged = first.new_zeros(len(batch), batch.tokens.shape[1])
        for rows, values in parts:
            merged[rows, : values[k].shape[1]] = values[k]
        out.append(merged)
    return tuple(out)


def reduce_metrics(totals: dict[str, float], seqs: int, global_seqs: float, summed: set[str]) -> dict[str, float]:
    """The step's metrics from every rank's: ``loss`` and ``summed`` keys add up (each rank's share of the
    batch value); the others are means over a rank's ``seqs`` samples, weighted by ``seqs / global_seqs``."""
    if rank_size()[1] == 1:
        return totals
    parts: list[Any] = [None] * rank_size()[1]
    dist.all_gather_object(parts, (seqs, totals))
    out: dict[str, float] = {}
    for n, metrics in parts:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + (v if k == "loss" or k in summed else v * n / global_seqs)
    return out
