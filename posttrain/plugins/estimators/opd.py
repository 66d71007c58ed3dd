"""On-policy distillation: each sampled token's advantage is the negative reverse KL to a teacher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain import hookimpl, option
from posttrain.api import Estimator, EstimatorNeeds
from posttrain.core.types import AdvantageBatch


class OnPolicyDistillation(Estimator):
    """On-policy distillation (Agarwal et al., 2024; Qwen3; Thinking Machines): ``A_t = -(logp_t - logq_t)``.

    Per response token ``t`` of sample ``i``, with ``logp`` the student's log-prob of its own sampled token
    (``batch.log_probs``, the trainer's before the update) and ``logq`` the teacher's log-prob of the same
    token (``batch.metadata["teacher_log_probs"]``, from the run's ``teacher:`` fleet)::

        A_it = -kl_coef * (logp_it - logq_it - b_i) + reward_weight * (r_i - mean_g) / (std_g + epsilon)

    ``logp - logq`` is the per-token (single-sample) estimate of the reverse KL ``KL(student || teacher)``
    on the student's own samples, so a policy-gradient loss (``ppo_clip``, ``reinforce``) with these
    advantages descends the reverse KL: mode-seeking, token-level credit, no reward model. The optional
    baseline ``b_i`` is 0 by default; ``baseline: leave_one_out`` takes the mean over the other samples
    of the same prompt of their token-mean ``logp - logq`` (0 for a group of one): it does not depend on
    sample ``i``'s tokens, so the gradient stays unbiased, and it removes the part of the KL the prompt
    alone explains (a fresh student is far from the teacher on every sample: without it most advantages
    share one large sign, and learning is slower; ``examples/distill`` uses it). The optional
    second term mixes in the task reward as GRPO does (group-standardized, Bessel-corrected std; a group
    of one keeps its raw reward); ``reward_weight: 0`` (the default) distills only. Where we differ
    from slime (which subtracts ``opd_kl_coef * (logp - logq)`` from another estimator's advantages) and
    verl: the reward term is GRPO's, built in; no discounting over later tokens (each token's own KL,
    as Thinking Machines' recipe). ``metrics``: ``reverse_kl`` (token mean of ``logp - logq``),
    ``teacher_log_prob`` and ``student_log_prob`` (token means), logged as ``estimator/...``.

    Shapes: ``log_probs``, ``metadata["teacher_log_probs"]``, ``response_mask``: ``[B, T]``; ``rewards``,
    ``group_index``: ``[B]`` -> advantages = returns ``[B, T]``, 0 where the mask is 0.
    """

    name = "opd"
    # reads AdvantageBatch.log_probs (the old policy's, before training: core.batching) and the teacher's
    # log-probs of every sample (posttrain.core.rollout.teacher)
    needs = EstimatorNeeds(log_probs=True, teacher=True)
    group_baseline = True  # the reward term is group-standardized; the KL term ignores rewards

    @dataclass
    class Config:
        kl_coef: float = option(1.0, ge=0.0, help="weight of the distillation term -(logp_student - logp_teacher)")
        baseline: Literal["none", "leave_one_out"] = option(
            "none", help="subtract the other samples' (same prompt) mean per-token reverse KL from each sample's")
        reward_weight: float = option(0.0, ge=0.0, help="weight of the task reward's GRPO advantage (0: distill only)")
        normalize_std: bool = option(True, help="the reward term divides by the group std")
        epsilon: float = option(1e-6, gt=0.0, help="added to the group std before dividing")

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self.metrics: dict[str, float] = {}

    def advantages(self, batch: AdvantageBatch):
        import torch

        from posttrain.core.group_stats import group_mean_std, group_sum_count, sequence_scores
        from posttrain.core.losses import masked_mean

        c = self.config
        rewards = sequence_scores(batch)
        teacher = batch.metadata.get("teacher_log_probs")
        if batch.log_probs is None or teacher is None:
            raise ValueError("opd needs AdvantageBatch.log_probs (the student's) and metadata['teacher_log_probs'] "
                             "([B, T]); a run gets them with a teacher: section")
        mask = batch.response_mask
        for key, tensor in (("log_probs", batch.log_probs), ("teacher_log_probs", teacher)):
            if tensor.shape != mask.shape:
                raise ValueError(f"opd: {key} has shape {tuple(tensor.shape)}, response_mask {tuple(mask.shape)}")
        on = mask > 0  # padding may hold anything: only masked tokens count
        reverse_kl = torch.where(on, batch.log_probs.float() - teacher.float(), 0.0)
        advantages = -c.kl_coef * reverse_kl
        if c.baseline == "leave_one_out":
            per_sample = reverse_kl.sum(-1) / mask.sum(-1).clamp(min=1)  # [B] token-mean reverse KL
            total, count = group_sum_count(per_sample, batch.group_index)
            others = torch.where(count > 1, (total - per_sample) / (count - 1).clamp(min=1), 0.0)
            advantages = advantages + c.kl_coef * others.unsqueeze(-1)
        if c.reward_weight:
            mean, std = group_mean_std(rewards, batch.group_index)
            scores = rewards - mean
            if c.normalize_std:
                scores = scores / (std + c.epsilon)
            advantages = advantages + c.reward_weight * scores.unsqueeze(-1)
        advantages = torch.where(on, advantages, 0.0)
        self.metrics = {"reverse_kl": float(masked_mean(reverse_kl, mask)),
                        "teacher_log_prob": float(masked_mean(torch.where(on, teacher.float(), 0.0), mask)),
                        "student_log_prob": float(masked_mean(torch.where(on, batch.log_probs.float(), 0.0), mask))}
        return advantages, advantages.clone()


@hookimpl
def posttrain_register_estimators(registry):
    registry.add(OnPolicyDistillation)
