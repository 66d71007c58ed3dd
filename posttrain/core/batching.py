"""From rolled-out samples to the trainer's batch, and the rollout metrics of a step."""

from __future__ import annotations

import itertools
from statistics import mean
from typing import TYPE_CHECKING, Any

from posttrain.core.interfaces import needs_of
from posttrain.core.train_batch import TrainBatch
from posttrain.core.types import Sample, SampleStatus

if TYPE_CHECKING:  # torch is imported where a batch is made: the driver starts its engines before importing it
    import torch


def trainable(groups: list[list[Sample]]) -> list[Sample]:
    """The samples a step trains on: every sample of the kept groups except failed ones (a reward or
    tool raised; counted in ``reward/failed``), aborted ones (the engine gave up on them; unscored) and
    those without a response."""
    dropped = (SampleStatus.FAILED, SampleStatus.ABORTED)
    return [s for g in groups for s in g if s.status not in dropped and s.response_length > 0]


def dropped_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    """``rollout/aborted``: samples of the kept groups the engine aborted (not trained on)."""
    return {"rollout/aborted": float(sum(s.status == SampleStatus.ABORTED for g in groups for s in g))}


def to_batch(samples: list[Sample]) -> tuple[TrainBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch, rewards [B], group_index [B], rollout_log_probs [B, T])`` for ``samples``.

    ``batch.response_mask`` is 1 exactly where ``sample.loss_mask`` is (model-generated response tokens);
    rollout log-probs sit at the same positions (column ``t`` scores ``tokens[:, t]``), 0 elsewhere.
    """
    import torch

    batch = TrainBatch.from_lists([s.tokens for s in samples], [s.prompt_length for s in samples])
    rollout = torch.zeros_like(batch.response_mask)
    response = batch.response_mask.bool()  # [B, T]: each sample's span prompt_length .. len(tokens)
    _fill_spans(batch.response_mask, response, samples, "loss_mask")
    _fill_spans(rollout, response, samples, "rollout_log_probs")
    batch.routed_experts = routed_experts(samples, batch.tokens.shape[1])
    if any(s.images for s in samples):
        batch.images = [list(s.images or []) for s in samples]
    rewards = torch.tensor([float(s.reward) for s in samples])
    group_index = torch.tensor([s.group_index for s in samples], dtype=torch.long)
    return batch, rewards, group_index, rollout


def _fill_spans(out: torch.Tensor, response: torch.Tensor, samples: list[Sample], attr: str) -> None:
    """Write each sample's per-response-token list ``attr`` (None: leave its row) into its span of
    ``out`` ``[B, T]``, in one assignment through the ``response`` mask (row-major: the lists' order)."""
    import numpy as np
    import torch

    rows = [getattr(s, attr) is not None for s in samples]
    if not any(rows):
        return
    where = response & torch.tensor(rows)[:, None]
    values = np.fromiter(itertools.chain.from_iterable(getattr(s, attr) for s, row in zip(samples, rows) if row),
                         dtype=np.float32)
    if len(values) != int(where.sum()):
        bad = [(len(getattr(s, attr)), len(s.tokens) - s.prompt_length) for s, row in zip(samples, rows) if row]
        got, want = next((b for b in bad if b[0] != b[1]), (len(values), int(where.sum())))
        raise ValueError(f"a sample's {attr} has {got} entries for {want} response tokens")
    out.masked_scatter_(where, torch.from_numpy(values).to(out.dtype))


def routed_experts(samples: list[Sample], width: int) -> torch.Tensor | None:
    """``[B, width, L * k]`` int16 expert ids from every sample's ``rollout_routed_experts`` (-1 past each
    sample's rows), or None unless every sample has them (a trainer then routes by itself)."""
    if not samples or any(s.rollout_routed_experts is None for s in samples):
        return None
    import torch

    out = torch.full((len(samples), width, samples[0].rollout_routed_experts.shape[-1]), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        out[i, : len(s.rollout_routed_experts)] = torch.from_numpy(s.rollout_routed_experts.astype("int16"))
    return out


def rollout_metrics(samples: list[Sample], weight_version: int) -> dict[str, float]:
    """``rollout/*`` metrics: reward, response length, truncation, staleness (versions behind)."""
    if not samples:
        return {"rollout/samples": 0.0}
    lengths = [s.response_length for s in samples]
    return {
        "rollout/samples": float(len(samples)),
        "rollout/reward_mean": mean(float(s.reward) for s in samples),
        "rollout/response_len_mean": mean(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": mean(float(s.status == SampleStatus.TRUNCATED) for s in samples),
        "rollout/staleness_max": float(max(weight_version - s.weight_version for s in samples)),
    }


def old_log_probs_from_train(cfg: Any, estimator: Any) -> bool:
    """Whether a step takes the old policy's log-probs from the training forward (``trainer.train(batch,
    keep_log_probs=True)``) instead of a separate ``trainer.log_probs`` pass before it.

    They are equal (the same weights, the same tokens; the loss detaches them) exactly when the batch is
    trained in one optimizer step, ``trainer.steps_per_rollout == 1``, and then PPO's ratio is 1 at that
    step either way. The rollout mode does not matter: both ways compute them with the trainer's current
    weights. Only when nothing reads them before the step: no ``correction`` (importance weights),
    ``trainer.kl_in_reward_coef == 0`` (the reward penalty), and an estimator that reads neither
    ``AdvantageBatch.log_probs`` (``needs.log_probs``) nor a teacher's (``needs.teacher``: opd). The
    step's metrics that use them (the engine gap, ``train/entropy``, ``train/kl``) are computed after
    training, from the same values. ``trainer.old_log_probs_from_train: false`` turns it off."""
    t, needs = cfg.trainer, needs_of(estimator)
    return (t.old_log_probs_from_train and t.steps_per_rollout == 1 and cfg.correction is None
            and t.kl_in_reward_coef == 0 and not needs.log_probs and not needs.teacher)


def train_tokens(samples: list[Sample]) -> int:
    """Prompt + response tokens of ``samples`` (what a train step's forward and backward run over)."""
    return sum(len(s.tokens) for s in samples)


def mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the engine's (same weights); the mean
    is the one every correction reports (``core.losses``), the max is for spotting single bad tokens (exactly 0
    at every token with ``rollout.exact``), ``_tokens`` how many tokens were compared."""
    from posttrain.core.losses import masked_mean

    diff = (train_log_probs - rollout_log_probs).abs()
    return {"train_rollout_logprob_abs_diff": float(masked_mean(diff, mask)),
            "train_rollout_logprob_abs_diff_max": float((diff * mask).max()) if mask.any() else 0.0,
            "train_rollout_logprob_tokens": float(mask.sum())}


def policy_metrics(batch: TrainBatch, entropy: torch.Tensor) -> dict[str, float]:
    """``train/entropy`` of the sampling policy and ``train/kl`` (k3) to the reference, token means
    over the response (before this step's update; the KL loss term reports its own during training)."""
    from posttrain.core.losses import aggregate, kl_divergence

    mask = batch.response_mask
    out = {"train/entropy": float(aggregate(entropy, mask, "token-mean"))}
    if batch.ref_log_probs is not None:
        kl = kl_divergence(batch.old_log_probs, batch.ref_log_probs, kind="k3")
        out["train/kl"] = float(aggregate(kl, mask, "token-mean"))
        # 0 before the first update: the reference snapshot and the policy are the same weights
        out["train/ref_policy_logprob_abs_diff"] = float(
            aggregate((batch.old_log_probs - batch.ref_log_probs).abs(), mask, "token-mean"))
    return out


def sample_log(samples: list[Sample], k: int = 2) -> list[dict[str, Any]]:
    """A few samples as plain data for the run log (prompt, response, reward)."""
    return [{"prompt": s.prompt if isinstance(s.prompt, str) else s.prompt[-1].get("content", ""),
             "response": s.response, "label": s.label, "reward": s.reward} for s in samples[:k]]
