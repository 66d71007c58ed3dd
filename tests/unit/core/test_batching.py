"""``batching.to_batch`` builds the padded ``[B, T]`` tensors in one scatter per field: the same tensors as
filling row by row, for every mix of samples with and without loss masks and rollout log-probs."""

import random

import pytest
import torch

from posttrain.core import batching
from posttrain.core.types import Sample


def _row_by_row(samples):
    width = max(len(s.tokens) for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    mask, rollout = torch.zeros(len(samples), width), torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        start, end = s.prompt_length, len(s.tokens)
        tokens[i, :end] = torch.tensor(s.tokens)
        mask[i, start:end] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_log_probs is not None:
            rollout[i, start:end] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return tokens, mask, rollout


def _samples(rng: random.Random) -> list[Sample]:
    out = []
    for g in range(rng.randint(1, 12)):
        prompt, response = rng.randint(1, 6), rng.randint(0, 7)
        s = Sample(prompt="p", tokens=[rng.randint(1, 99) for _ in range(prompt + response)], response_length=response,
                   reward=float(g % 2), group_index=g)
        if rng.random() < 0.5:
            s.loss_mask = [rng.randint(0, 1) for _ in range(response)]
        if rng.random() < 0.7:
            s.rollout_log_probs = [rng.gauss(0.0, 3.0) for _ in range(response)]
        out.append(s)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_to_batch_equals_row_by_row(seed):
    samples = _samples(random.Random(seed))
    batch, rewards, group_index, rollout = batching.to_batch(samples)
    tokens, mask, want_rollout = _row_by_row(samples)
    assert torch.equal(batch.tokens, tokens) and batch.tokens.dtype == torch.long
    assert torch.equal(batch.response_mask, mask) and batch.response_mask.dtype == torch.float32
    assert torch.equal(rollout, want_rollout)
    assert batch.lengths.tolist() == [len(s.tokens) for s in samples]
    assert rewards.tolist() == [s.reward for s in samples] and group_index.tolist() == [s.group_index for s in samples]


def test_a_loss_mask_of_the_wrong_length_is_named():
    s = Sample(prompt="p", tokens=[1, 2, 3], response_length=1, reward=0.0, loss_mask=[1, 1])
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 1 response tokens"):
        batching.to_batch([s])


def test_generator_metrics_sum_counts_and_average_per_sample_values():
    from posttrain.core.batching import generator_metrics
    from posttrain.core.types import Sample

    a = Sample(prompt="a", metadata={"rollout_sums": {"agent_failed": 1.0}, "rollout_means": {"turns": 3.0}})
    b = Sample(prompt="b", metadata={"rollout_sums": {"agent_failed": 1.0}, "rollout_means": {"turns": 1.0}})
    c = Sample(prompt="c")  # a fan-out copy: carries none, counts in neither
    assert generator_metrics([[a, c], [b]]) == {"rollout/agent_failed": 2.0, "rollout/turns": 2.0}
    assert generator_metrics([[c]]) == {}
