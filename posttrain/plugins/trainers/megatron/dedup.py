"""Samples with the same inputs run the model once (padded micro-batches, ``trainer.backend.dedup_inputs``).

In a padded row ``b`` the hidden state at position ``t`` depends only on ``tokens[b, :t + 1]`` (causal
attention), and the positions a loss reads are ``t < len_b - 1`` (the last token predicts nothing). Rows
with the same ``tokens[b, :len_b - 1]`` and the same length therefore have the same hidden states at every
position that is read. The model runs over one representative of each, ``[U, T]``, and the hidden states
are gathered back to ``[B, T, H]``; backward sums the duplicates' gradients into their representative
(``index_select``'s backward), the same gradient as running them all, up to float summation order.

GRPO makes such rows: ``n`` samples of one prompt with one-token answers (the CPU quickstart: 1,024
samples, 64 distinct inputs, so the layers run over 64 rows instead of 1,024), or a policy that repeats one
answer. Off where inputs are not all a row sees: dropout (duplicates would share one mask), MoE (the
load-balancing loss counts tokens; routing replay is per sample), packed rows (``sequence_packing``).
"""

from __future__ import annotations

import torch


def distinct_rows(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(tokens [U, T], inverse [B] | None)``: one row per distinct input (its first sample) and each
    sample's row among them; ``(tokens, None)`` when every row is distinct.

    ``tokens [B, T]`` long, ``lengths [B]`` (tokens per sample, on ``tokens``' device).
    """
    rows, width = tokens.shape
    lengths = lengths.to(tokens.device)
    read = torch.arange(width, device=tokens.device)[None, :] < (lengths - 1)[:, None]  # inputs a loss reads
    keys = torch.cat([torch.where(read, tokens, -1), lengths[:, None].to(tokens.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    count = int(inverse.max()) + 1 if rows else 0
    if count == rows:
        return tokens, None
    order = torch.arange(rows, device=tokens.device)
    first = torch.full((count,), rows, dtype=order.dtype, device=tokens.device).scatter_reduce(
        0, inverse, order, reduce="amin")  # the first sample of each distinct input
    return tokens.index_select(0, first), inverse
