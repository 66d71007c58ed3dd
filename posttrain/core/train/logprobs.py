"""Token log-probs and entropy from vocab-parallel logits, computed in chunks of tokens.

For hidden states ``h [N, H]`` (after the final norm) and this rank's output-layer shard
``W_r [V/tp, H]`` holding vocabulary rows ``[v0, v0 + V/tp)``::

    z_r = h W_r^T                                   # [n, V/tp], one chunk of n tokens at a time, fp32
    m   = max_r max_v z_r          (all-reduce MAX, no gradient)
    S   = sum_r sum_v exp(z_r - m) (all-reduce SUM)
    lse = m + log S
    log p(y) = z[y] - lse          (z[y] lives on one rank: all-reduce SUM of the masked gather)
    H        = lse - sum_v p_v z_v (all-reduce SUM)

Only one chunk's ``[n, V/tp]`` fp32 logits exist at a time: each chunk runs under activation
checkpointing, so backward recomputes its logits instead of keeping them (the full ``[N, V]`` fp32
tensor of a 150k vocabulary is what dominates memory in RL). All-reduces are Megatron's
``reduce_from_tensor_model_parallel_region`` (sum forward, identity backward: every rank computes the
same loss), and ``h`` enters through ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce of its gradient backward), exactly as a vocab-parallel cross-entropy does.
Vocabulary padding rows (index >= ``vocab_size``) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

_NEG = -1e30  # finite "minus infinity": exp() gives 0 and 0 * _NEG stays 0 in the entropy sum


def _chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = (h @ weight.t()).float()  # [n, Vr]
    local_vocab = logits.shape[-1]
    if vocab_start + local_vocab > vocab_size:  # padding rows on this rank
        valid = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) < vocab_size
        logits = logits.masked_fill(~valid, _NEG)
    m = logits.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    e = torch.exp(logits - m.unsqueeze(-1))
    s = tp_sum(e.sum(dim=-1))
    lse = m + torch.log(s)
    local = targets - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    picked = logits.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = tp_sum(torch.where(inside, picked, torch.zeros_like(picked)))
    log_probs = target_logit - lse
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    p = e / s.unsqueeze(-1)
    entropy = lse - tp_sum((p * logits).sum(dim=-1))
    return log_probs, entropy


def vocab_parallel_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             vocab_size: int, chunk_size: int = 1024, with_entropy: bool = False,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets)`` and (optionally) the entropy, per token.

    :param hidden: ``[N, H]`` final hidden states (any float dtype; logits are accumulated in fp32).
    :param weight: ``[V/tp, H]`` this rank's output-layer rows (vocabulary-parallel, possibly padded).
    :param targets: ``[N]`` token ids (global vocabulary indices).
    :param vocab_size: the true vocabulary size; rows at or beyond it are padding.
    :param chunk_size: tokens per chunk; peak extra memory is ``chunk_size x V/tp`` fp32 values.
    :returns: ``log_probs [N]`` (fp32) and ``entropy [N]`` (fp32) or None.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    rank = parallel_state.get_tensor_model_parallel_rank()
    vocab_start = rank * weight.shape[0]
    hidden = copy_to_tensor_model_parallel_region(hidden)
    lps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start:start + chunk_size], weight, targets[start:start + chunk_size], vocab_start,
                vocab_size, with_entropy)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    log_probs = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    return log_probs, (torch.cat(ents) if with_entropy and ents else None)
