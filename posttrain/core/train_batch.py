"""The batch the trainer consumes, and how variable-length samples are packed for Megatron.

Every per-token tensor is ``[B, T]`` and aligned with ``tokens``: column ``t`` describes token
``tokens[:, t]``. So ``log_probs[b, t] = log p(tokens[b, t] | tokens[b, :t])``; column 0 has no prefix and
is 0 (a prompt always precedes the response, so ``response_mask[:, 0] == 0``). Samples are right-padded;
``lengths[b]`` counts the real tokens of sample ``b`` (prompt + response).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a batch is made: the driver starts its engines before importing torch
    import torch


@dataclass
class TrainBatch:
    """One optimizer step's samples (or a micro-batch of them).

    :ivar tokens: ``[B, T]`` long, prompt + response ids, right-padded.
    :ivar lengths: ``[B]`` long, real tokens per sample.
    :ivar response_mask: ``[B, T]`` float, 1 on response tokens that are trained on (tool output: 0).
    :ivar advantages: ``[B, T]`` float (0 off the response), or None for log-prob-only batches.
    :ivar old_log_probs: ``[B, T]`` log-probs of the policy that sampled (or the pre-update policy).
    :ivar ref_log_probs: ``[B, T]`` reference-policy log-probs, for the KL loss term.
    :ivar is_weights: ``[B, T]`` importance-sampling weights (rollout/training mismatch), or None.
    :ivar returns: ``[B, T]`` value targets for the critic, or None.
    :ivar old_values: ``[B, T]`` critic values at rollout time (value clipping), or None.
    :ivar routed_experts: ``[B, T, L * k]`` int16, the engine's MoE expert ids of token ``t`` in each of the
        ``L`` layers (``k`` per layer; -1 where the engine reported none: dense layers, each sample's last
        token, padding), or None. A trainer that replays routing reads them (Sample.rollout_routed_experts).
    :ivar temperature: the sampling temperature ``T`` of the rollout. Engines report ``log_softmax(z / T)``
        of the token they drew, so the trainer scores ``log_softmax(z / T)`` too (and the entropy of that
        distribution): the policy-gradient ratio is against the distribution that sampled. ``T`` of 0
        (greedy) or 1 leaves the logits as they are.
    :ivar images: ``B`` lists of image references (:mod:`posttrain.core.vision`; ``[]`` for a text-only sample),
        in the order of each sample's image tokens, or None when no sample has images. Not a tensor: a
        vision-language trainer turns a micro-batch's into pixels.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    images: list[list[str]] | None = None
    temperature: float = 1.0

    @property
    def logit_scale(self) -> float:
        """``1 / T`` for a sampling temperature ``T`` other than 0 and 1, else 1.0 (see ``temperature``)."""
        return 1.0 / self.temperature if self.temperature not in (0.0, 1.0) else 1.0

    @classmethod
    def from_lists(cls, token_lists: list[list[int]], prompt_lengths: list[int], **per_token: Any) -> "TrainBatch":
        """Pad ``token_lists``; the response mask covers everything after each prompt.

        One array from the concatenated lists, scattered through the ``[B, width]`` mask of valid positions
        (row-major, so in concatenation order): a tensor per row cost ~15 ms a step at 1,024 samples."""
        import numpy as np
        import torch

        lengths = torch.tensor([len(t) for t in token_lists])
        width = int(lengths.max())
        columns = torch.arange(width)[None, :]
        valid = columns < lengths[:, None]
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
        tokens = torch.zeros(len(token_lists), width, dtype=torch.long).masked_scatter_(valid, torch.from_numpy(flat))
        mask = (valid & (columns >= torch.tensor(prompt_lengths)[:, None])).float()
        return cls(tokens=tokens, lengths=lengths, response_mask=mask, **per_token)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, start: int, end: int) -> "TrainBatch":
        """Samples ``start:end``, trimmed to their longest length."""
        width = int(self.lengths[start:end].max())
        kw = {}
        for f in _per_sample_fields(self):
            v = getattr(self, f.name)
            if v is None:
                kw[f.name] = None
            elif f.name in ("lengths", "images"):
                kw[f.name] = v[start:end]
            else:
                kw[f.name] = v[start:end, :width]
        return replace(self, **kw)

    def take(self, index: list[int]) -> "TrainBatch":
        """Samples ``index`` (rows, in that order), trimmed to their longest length: a data-parallel share."""
        import torch

        rows = torch.as_tensor(index, dtype=torch.long)
        width = int(self.lengths[rows].max())
        kw = {}
        for f in _per_sample_fields(self):
            v = getattr(self, f.name)
            kw[f.name] = (None if v is None else v[rows] if f.name == "lengths" else [v[i] for i in index]
                          if f.name == "images" else v[rows, :width])
        return replace(self, **kw)

    def to(self, device: Any) -> "TrainBatch":
        kw = {}
        for f in _per_sample_fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if v is not None and f.name != "images" else v
        return replace(self, **kw)


@dataclass
class Packed:
    """Samples concatenated into one row for THD attention.

    ``input_ids [1, N]``, ``position_ids [1, N]`` (restart at 0 per sample), ``targets [N]`` (next token,
    0 at each sample's last position), ``cu_seqlens [B + 1]`` int32 (and ``cu_host``, the same offsets as
    a Python list: attention and unpacking read them without a device-to-host copy per layer).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    cu_host: list[int]

    def unpack(self, values: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """``values [N]`` per packed position (prediction of the next token) -> ``[B, width]`` aligned."""
        out = values.new_zeros(len(lengths), width)
        for b, (start, n) in enumerate(zip(self.cu_host[:-1], lengths.tolist())):
            out[b, 1:n] = values[start:start + n - 1]
        return out


def pack(tokens: torch.Tensor, lengths: torch.Tensor) -> Packed:
    """Concatenate the real tokens of each row of ``tokens [B, T]``."""
    import torch

    sizes = lengths.tolist()
    pieces = [tokens[b, :n] for b, n in enumerate(sizes)]
    ids = torch.cat(pieces)
    positions = torch.cat([torch.arange(len(p), device=tokens.device) for p in pieces])
    targets = torch.cat([torch.cat([p[1:], p.new_zeros(1)]) for p in pieces])
    cu_host = [0]
    for n in sizes:
        cu_host.append(cu_host[-1] + n)
    cu = torch.tensor(cu_host, dtype=torch.int32).to(tokens.device)
    return Packed(ids.unsqueeze(0), positions.unsqueeze(0), targets, cu, max(sizes), cu_host)


def _per_sample_fields(batch: TrainBatch) -> list:
    """The batch's per-sample fields (every field but ``temperature``, which holds for the whole batch)."""
    return [f for f in fields(batch) if f.name != "temperature"]


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Sample indices of each of ``parts`` shares, balanced by token count (``lengths``: tokens per
    sample). Longest first, each sample goes to the share with the fewest tokens so far (ties: fewer
    samples, then the lower share): no share is empty while there are samples for all, and the largest
    is within 4/3 of the best possible (greedy LPT). Each share keeps sample order."""
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} samples cannot be split over {parts} data-parallel ranks")
    heap = [(0, 0, p) for p in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, count, p = heapq.heappop(heap)
        shares[p].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, p))
    return [sorted(s) for s in shares]
