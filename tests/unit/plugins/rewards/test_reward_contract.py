"""Every reward the issue names is a built-in (tests/contract runs the reward contract over each)."""

from posttrain.core.plugins import load_plugins

PLUGINS = load_plugins()
BUILTIN = sorted(n for n in PLUGINS.rewards if (PLUGINS.rewards.provider(n) or None) and
                 PLUGINS.rewards.provider(n).distribution == "posttrain")


def test_all_built_ins_are_covered():
    assert {"math", "f1", "choice", "regex", "overlong", "length", "remote", "code", "exact_match"} <= set(BUILTIN)
