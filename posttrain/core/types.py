"""The data that crosses plugin boundaries: plain dataclasses, no torch import at module level.

Notation used in shapes: ``B`` samples in a batch, ``T`` response tokens (padded), ``G`` group size
(``n_samples_per_prompt``). A *group* is the set of samples generated from one prompt; samples of a
group share ``group_index`` (an id, not a position: groups need not be contiguous).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported for annotations only: entry modules must stay import-light
    import torch


class SampleStatus(str, enum.Enum):
    """Lifecycle of a sample. ``truncated`` means ``max_new_tokens`` was hit; ``aborted`` samples
    (partial rollouts) go back to the data buffer; ``failed`` samples (a reward or tool raised) are
    counted and excluded from training."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt-response pair as it moves through the loop.

    ``tokens`` holds prompt and response token ids together; the response is the last
    ``response_length`` of them. ``loss_mask`` and ``rollout_log_probs`` cover the response only
    (length ``response_length``): ``loss_mask`` is 1 on tokens the model generated and 0 on tokens
    inserted by the environment (tool results in multi-turn rollouts).
    """

    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.PENDING
    group_index: int = 0
    index: int = 0
    weight_version: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` (the subset posttrain sets; ``extra`` passes anything else through)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def to_sglang(self) -> dict[str, Any]:
        """The JSON object SGLang's ``/generate`` takes as ``sampling_params``."""
        out = {k: v for k, v in vars(self).items() if k != "extra" and v is not None}
        out.update(self.extra)
        return out


@dataclass
class AdvantageBatch:
    """Input of every advantage estimator (one object, so the caller never builds per-estimator kwargs).

    - ``rewards``: ``[B]`` float, one outcome reward per sample.
    - ``group_index``: ``[B]`` int64, samples of one prompt share an id.
    - ``response_mask``: ``[B, T]`` float, 1.0 on response tokens that train, 0.0 elsewhere.
    - ``values``: ``[B, T]`` critic values (estimators with ``needs_critic = True``), else None.
    - ``token_rewards``: ``[B, T]`` optional dense per-token rewards added to the outcome reward.
    - ``metadata``: per-batch extras some estimators need (e.g. ``baseline_rewards`` ``[B]`` for ReMax).
    """

    rewards: torch.Tensor
    group_index: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
