"""The data that crosses plugin boundaries: plain dataclasses, no torch import at module level.

Notation used in shapes: ``B`` samples in a batch, ``T`` response tokens (padded), ``G`` group size
(``n_samples_per_prompt``). A *group* is the set of samples generated from one prompt; samples of a
group share ``group_index`` (an id, not a position: groups need not be contiguous).
"""

from __future__ import annotations

import enum
import hashlib
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
    inserted by the environment (tool results in multi-turn rollouts). ``rollout_routed_experts`` (MoE
    models, when the trainer replays routing): the engine's expert ids, int32 ``[len(tokens) - 1, L * k]``
    (row ``t``: token ``t`` in each of the ``L`` layers, ``k`` experts each, -1 where none), SGLang's
    ``meta_info.routed_experts``. ``weight_version``: the engine's weight version when the response ended;
    ``weight_versions``: the version that generated each response token (``response_length`` ints; a
    partial rollout continued across a weight push spans several; tokens inserted by the environment get
    their turn's), None when the generator did not record them. ``images``: the prompt's image references
    (:mod:`posttrain.core.vision`: absolute paths or base64), in the order of the image tokens; the engines get
    them as ``image_data`` and the trainer computes its log-probs on the same pixels.
    """

    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.PENDING
    group_index: int = 0
    index: int = 0
    weight_version: int = 0
    weight_versions: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None
    images: list[str] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among the response's tokens (``weight_version`` when none are recorded)."""
        return min(self.weight_versions) if self.weight_versions else self.weight_version


def row_seed(seed: int, j: int) -> int:
    """The seed row ``j`` of a batch sharing one seeded ``sampling_params`` draws with on engines that
    seed by row (``seed_rows``: posttrain's local engine): ``seed + j``, wrapped into int64 so that a seed
    near ``2**63`` cannot overflow a row's."""
    return (seed + j + 2**63) % 2**64 - 2**63


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` (the subset posttrain sets; ``extra`` passes anything else through).

    ``seed``: the run's sampling seed (``rollout.seed_sampling``), or None to sample unseeded. It is not
    sent as is: :meth:`for_sample` turns it into one ``sampling_seed`` per sample and turn, so every
    sample draws its own stream and a rerun draws the same ones. ``seed_rows``: the engines seed row
    ``j`` of a batched request with ``sampling_seed + j`` (posttrain's local engine does; SGLang does
    not), so a seeded group can still go as one request (:meth:`for_group`). ``return_routed_experts``: a
    request-level field (not a sampling parameter): generators add :meth:`request_fields` to each
    ``/generate``, and the engines answer with the experts every token went to (MoE models).
    """

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
    seed: int | None = None
    seed_rows: bool = False
    return_routed_experts: bool = False

    def to_sglang(self) -> dict[str, Any]:
        """The JSON object SGLang's ``/generate`` takes as ``sampling_params`` (unseeded)."""
        skip = ("extra", "seed", "seed_rows", "return_routed_experts")
        out = {k: v for k, v in vars(self).items() if k not in skip and v is not None}
        out.update(self.extra)
        return out

    def request_fields(self) -> dict[str, Any]:
        """Top-level ``/generate`` fields besides the prompt and ``sampling_params``."""
        return {"return_routed_experts": True} if self.return_routed_experts else {}

    def for_sample(self, sample: Sample, turn: int = 0) -> dict[str, Any]:
        """:meth:`to_sglang` for one sample's ``turn``-th ``/generate``: with a run ``seed``, adds
        ``sampling_seed``, a hash of ``(seed, sample.index, turn)`` (``sample.index`` is unique in a run
        and survives resume). Generators call this rather than :meth:`to_sglang` so seeded runs repeat."""
        out = self.to_sglang()
        seed = self.sampling_seed(sample, turn)
        if seed is not None:
            out["sampling_seed"] = seed
        return out

    def sampling_seed(self, sample: Sample, turn: int = 0) -> int | None:
        """The ``sampling_seed`` of one sample's ``turn``-th request (None when the run is unseeded)."""
        if self.seed is None:
            return None
        key = f"{self.seed}/{sample.index}/{turn}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "little")

    def for_group(self, group: list[Sample]) -> dict[str, Any] | None:
        """One ``sampling_params`` for the whole ``group`` sent as one batched request, or None when that
        cannot keep a seeded run's samples distinct (seeded, and the engines do not seed by row)."""
        if self.seed is None:
            return self.to_sglang()
        return self.for_sample(group[0]) if self.seed_rows else None


@dataclass
class AdvantageBatch:
    """Input of every advantage estimator (one object, so the caller never builds per-estimator kwargs).

    - ``rewards``: ``[B]`` float, one outcome reward per sample.
    - ``group_index``: ``[B]`` int64, samples of one prompt share an id.
    - ``response_mask``: ``[B, T]`` float, 1.0 on response tokens that train, 0.0 elsewhere.
    - ``values``: ``[B, T]`` critic values (estimators whose ``needs.critic`` is set), else None.
    - ``token_rewards``: ``[B, T]`` optional dense per-token rewards added to the outcome reward.
    - ``log_probs``: ``[B, T]`` the policy's log-probs of the sampled tokens (the trainer's, before the
      update), for estimators that compare the policy with another model (on-policy distillation);
      None unless the estimator declares ``needs.log_probs`` (or ``needs.teacher``) or the loop
      computes them before training anyway (``core.batching.old_log_probs_from_train``).
    - ``metadata``: per-batch extras some estimators need (e.g. ``baseline_rewards`` ``[B]`` for ReMax,
      ``teacher_log_probs`` ``[B, T]`` for distillation; see ``posttrain.core.estimator_inputs``).
    """

    rewards: torch.Tensor
    group_index: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
