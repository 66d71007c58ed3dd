"""Every algorithm the issue names is registered (tests/contract runs the contracts over each of them)."""

from __future__ import annotations

from posttrain.core.plugins import load_plugins

PLUGINS = load_plugins()


def test_every_algorithm_is_registered():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax",
            "opo", "gpg", "grpo_passk"} <= set(PLUGINS.estimators)
    assert {"ppo_clip", "gspo", "cispo", "gmpo", "reinforce"} <= set(PLUGINS.losses)
    assert {"tis", "mis", "icepop"} <= set(PLUGINS.corrections)
