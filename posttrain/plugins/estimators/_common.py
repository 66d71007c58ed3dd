"""Input checks shared by the built-in estimators (import-light: torch is imported inside functions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from posttrain.core.types import AdvantageBatch


def check_batch(batch: AdvantageBatch, needs_values: bool = False) -> torch.Tensor:
    """Validate shapes and finiteness; return the rewards ``[B]`` as float32.

    A NaN or inf in ``rewards``, ``token_rewards`` or ``values`` raises ``ValueError`` naming the sample.
    """
    import torch

    from posttrain.core.group_stats import check_finite

    b = batch.response_mask.shape[0]
    if batch.response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(batch.response_mask.shape)}")
    if tuple(batch.rewards.shape) != (b,) or tuple(batch.group_index.shape) != (b,):
        raise ValueError(f"rewards {tuple(batch.rewards.shape)} and group_index {tuple(batch.group_index.shape)} "
                         f"must be [B] with B = {b} (response_mask rows)")
    for key in ("token_rewards", "values"):
        tensor = getattr(batch, key)
        if tensor is not None:
            if tensor.shape != batch.response_mask.shape:
                raise ValueError(f"{key} has shape {tuple(tensor.shape)}, response_mask "
                                 f"{tuple(batch.response_mask.shape)}")
            # padding may hold anything: only tokens under the mask must be finite
            check_finite(torch.where(batch.response_mask > 0, tensor.float(), 0.0), what=key.rstrip("s"))
    if needs_values and batch.values is None:
        raise ValueError("this estimator needs critic values: AdvantageBatch.values [B, T] is None")
    return check_finite(batch.rewards)


def masked_token_rewards(batch: AdvantageBatch) -> torch.Tensor | None:
    """``token_rewards [B, T]`` as float32 with 0 outside the mask (whatever padding held), or None."""
    import torch

    if batch.token_rewards is None:
        return None
    return torch.where(batch.response_mask > 0, batch.token_rewards.float(), 0.0)


def sequence_scores(batch: AdvantageBatch) -> torch.Tensor:
    """``[B]`` outcome reward plus the sum of the masked ``token_rewards`` of each sample."""
    rewards = check_batch(batch)
    token_rewards = masked_token_rewards(batch)
    if token_rewards is not None:
        rewards = rewards + token_rewards.sum(-1)
    return rewards
