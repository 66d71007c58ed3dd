"""Group-baseline estimators against a plain-Python reference on random group layouts (hypothesis):
uneven and singleton groups, interleaved ids, ties, empty responses."""

from __future__ import annotations

import math
import statistics

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.core.plugins import load_plugins
from posttrain.core.types import AdvantageBatch

PLUGINS = load_plugins(autoload=False)  # posttrain's own: a third-party plugin installed changes nothing


def reference(name: str, rewards: list[float], groups: list[int], lengths: list[int]) -> list[float]:
    """Per-sample advantage, written the slow and obvious way."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [j for j, h in enumerate(groups) if h == g]
        rs = [rewards[j] for j in members]
        n = len(rs)
        if name == "grpo":
            out.append(r if n == 1 else (r - statistics.fmean(rs)) / (statistics.stdev(rs) + 1e-6))
        elif name == "dr_grpo":
            out.append(r if n == 1 else r - statistics.fmean(rs))
        elif name == "rloo":
            out.append(r if n == 1 else r - (sum(rs) - r) / (n - 1))
        elif name == "grpo_passk":
            if n == 1:
                out.append(r / (1 + 1e-6))
                continue
            top = sorted(rs, reverse=True)
            best_once = r == top[0] and rs.count(r) == 1
            out.append((top[0] - top[1]) / (statistics.stdev(rs) + 1e-6) if best_once else 0.0)
        elif name == "opo":
            ls = [lengths[j] for j in members]
            baseline = 0.0 if n == 1 or sum(ls) == 0 else sum(l * x for l, x in zip(ls, rs)) / sum(ls)
            out.append(r - baseline)
    return out


samples = st.lists(st.tuples(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 3.0]), st.integers(0, 5), st.integers(0, 4)),
                   min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(samples=samples, name=st.sampled_from(["grpo", "dr_grpo", "rloo", "opo", "grpo_passk"]))
def test_matches_reference(samples, name):
    rewards, groups, lengths = (list(x) for x in zip(*samples))
    mask = (torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]).float()
    batch = AdvantageBatch(rewards=torch.tensor(rewards), group_index=torch.tensor(groups) * 11,
                           response_mask=mask)
    cls = PLUGINS.estimators[name]
    adv, _ = cls(cls.Config()).advantages(batch)
    expected = torch.tensor(reference(name, rewards, groups, lengths), dtype=torch.float32)[:, None] * mask
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=1e-4)
    assert all(math.isfinite(v) for v in adv.flatten().tolist())
