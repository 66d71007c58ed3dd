"""Data-parallel shares of a batch: balanced by token count, every sample once, sample order kept."""

import random

import pytest
import torch

from posttrain.core.train_batch import TrainBatch
from posttrain.plugins.trainers.megatron.data_parallel import split_by_tokens


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_shares_cover_every_sample_once_balanced_by_tokens(parts):
    rng = random.Random(parts)
    lengths = [rng.choice([5, 5, 6, 40, 300]) for _ in range(64)]
    shares = split_by_tokens(lengths, parts)
    assert sorted(i for s in shares for i in s) == list(range(64))
    assert all(s == sorted(s) and s for s in shares)
    loads = [sum(lengths[i] for i in s) for s in shares]
    # greedy longest-first: the heaviest share exceeds the lightest by at most one sample's tokens
    assert max(loads) - min(loads) <= max(lengths)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) > 1 or parts == 8, "balanced by tokens, not by sample count"


def test_equal_lengths_alternate_and_too_few_samples_fail():
    assert split_by_tokens([5] * 5, 2) == [[0, 2, 4], [1, 3]]
    assert split_by_tokens([1, 9, 1, 1], 2) == [[1], [0, 2, 3]]
    with pytest.raises(ValueError, match="3 samples cannot be split over 4"):
        split_by_tokens([1, 2, 3], 4)


def test_take_picks_rows_and_trims_width():
    batch = TrainBatch.from_lists([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], [1, 1, 1],
                                  advantages=torch.arange(15.0).reshape(3, 5))
    part = batch.take([2, 1])
    assert part.tokens.tolist() == [[8, 9, 10], [6, 7, 0]] and part.lengths.tolist() == [3, 2]
    assert part.advantages.tolist() == [[10.0, 11.0, 12.0], [5.0, 6.0, 7.0]] and part.old_log_probs is None
