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
tensor of a 150k vocabulary is what dominates memory in RL). With ``recompute=False`` each chunk keeps
its logits in the matmul's dtype (bf16 on a GPU: ``2 N V/tp`` bytes, half of one fp32 copy) and a
hand-written backward uses them, with the saved ``lse`` (and ``sum_v p_v z_v``)::

    d log p(y) / dz_v = [v = y] - p_v          d H / dz_v = -p_v (z_v - sum_u p_u z_u)

which saves the output-layer matmul that recomputation repeats (a third of that layer's FLOPs). All-reduces are Megatron's
``reduce_from_tensor_model_parallel_region`` (sum forward, identity backward: every rank computes the
same loss), and ``h`` enters through ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce of its gradient backward), exactly as a vocab-parallel cross-entropy does.
Vocabulary padding rows (index >= ``vocab_size``) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from posttrain.core import exact

_NEG = -1e30  # finite "minus infinity": exp() gives 0 and 0 * _NEG stays 0 in the entropy sum


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return parallel_state.get_tensor_model_parallel_group()
    return None


def _masked(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """``logits`` as fp32 ``[n, Vr]`` with vocabulary padding rows at ``_NEG``."""
    z = logits.float()
    if vocab_start + z.shape[-1] > vocab_size:
        valid = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device) < vocab_size
        z = z.masked_fill(~valid, _NEG)
    return z


def _softmax_terms(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, with_entropy: bool):
    """From this rank's masked fp32 logits ``z [n, Vr]``: ``(log_probs, entropy, lse, pz, local, inside)``.

    ``lse`` and ``pz = sum_v p_v z_v`` are global over ranks; ``local`` is the target's column on this
    rank (clamped) and ``inside`` whether the target lives here. Sums cross ranks through Megatron's
    ``reduce_from_tensor_model_parallel_region`` (differentiable when autograd records them).
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    group = _tp_group()
    m = z.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))
    s = tp_sum(exact.row_sum(e)[..., 0] if exact.enabled() else e.sum(dim=-1))  # exact: the engine's sum
    lse = m + torch.log(s)
    local = targets - vocab_start
    inside = (local >= 0) & (local < z.shape[-1])
    local = local.clamp(0, z.shape[-1] - 1)
    picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    log_probs = tp_sum(torch.where(inside, picked, torch.zeros_like(picked))) - lse
    if not with_entropy:
        zeros = torch.zeros_like(log_probs)
        return log_probs, zeros, lse, zeros, local, inside
    pz = tp_sum(((e / s.unsqueeze(-1)) * z).sum(dim=-1))
    return log_probs, lse - pz, lse, pz, local, inside


def _chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    z = _masked(h @ weight.t(), vocab_start, vocab_size)  # [n, Vr]
    return _softmax_terms(z, targets, vocab_start, with_entropy)[:2]


class _KeptLogitsChunk(torch.autograd.Function):
    """One chunk's log-probs (and entropy) that keeps its logits for backward instead of recomputing.

    Communication happens in forward only (all-reduce of max, sum, target logit, ``sum p z``); backward
    is local: the gradient of ``h`` is summed over ranks by ``copy_to_tensor_model_parallel_region``
    outside, as on the checkpointed path.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, vocab_size, with_entropy):
        logits = h @ weight.t()  # [n, Vr] in h's dtype: kept for backward
        lp, ent, lse, pz, local, inside = _softmax_terms(_masked(logits, vocab_start, vocab_size), targets,
                                                         vocab_start, with_entropy)
        ctx.save_for_backward(h, weight, logits, lse, pz, local, inside)
        ctx.vocab = (vocab_start, vocab_size, with_entropy)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, logits, lse, pz, local, inside = ctx.saved_tensors
        vocab_start, vocab_size, with_entropy = ctx.vocab
        z = _masked(logits, vocab_start, vocab_size)
        p = torch.exp(z - lse.unsqueeze(-1))  # [n, Vr], the global softmax restricted to this rank
        d = p * -g_lp.unsqueeze(-1)
        if with_entropy and g_ent is not None:
            d -= g_ent.unsqueeze(-1) * p * (z - pz.unsqueeze(-1))
        d.scatter_add_(-1, local.unsqueeze(-1), torch.where(inside, g_lp, torch.zeros_like(g_lp)).unsqueeze(-1))
        d = d.to(logits.dtype)
        grad_h = d @ weight if ctx.needs_input_grad[0] else None
        grad_w = d.t() @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None


def vocab_parallel_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             vocab_size: int, chunk_size: int = 1024, with_entropy: bool = False,
                             recompute: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets)`` and (optionally) the entropy, per token.

    :param hidden: ``[N, H]`` final hidden states (any float dtype; logits are accumulated in fp32).
    :param weight: ``[V/tp, H]`` this rank's output-layer rows (vocabulary-parallel, possibly padded).
    :param targets: ``[N]`` token ids (global vocabulary indices).
    :param vocab_size: the true vocabulary size; rows at or beyond it are padding.
    :param chunk_size: tokens per chunk; peak extra memory is ``chunk_size x V/tp`` fp32 values.
    :param recompute: backward recomputes each chunk's logits (least memory); False keeps them in the
        matmul's dtype (``N x V/tp`` values) and skips the repeated output-layer matmul.
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
        if not grad:
            lp, ent = _chunk(*args)
        elif recompute:
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _KeptLogitsChunk.apply(*args)
        lps.append(lp)
        ents.append(ent)
    log_probs = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    return log_probs, (torch.cat(ents) if with_entropy and ents else None)
