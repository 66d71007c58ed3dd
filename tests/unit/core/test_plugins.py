import json
import subprocess
import sys
import textwrap

import pytest

from posttrain.core.errors import PluginError
from posttrain.core.plugins import load_plugins

REWARD_PLUGIN = '''
from dataclasses import dataclass
from posttrain import hookimpl

class Shout:
    """Scores 1.0 for responses in upper case."""
    name = "{name}"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
    def __call__(self, sample):
        return float(sample.response.isupper())

@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Shout)
'''


def fake_distribution(root, dist: str, entry_points: dict[str, str], modules: dict[str, str]):
    """A real installed distribution on disk (dist-info with entry_points.txt) under ``root``."""
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[posttrain]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for name, text in modules.items():
        (root / f"{name}.py").write_text(text)
    return root


def test_builtins_come_from_the_posttrain_distribution():
    plugins = load_plugins()
    assert "grpo" in plugins.estimators and "exact_match" in plugins.rewards
    info = plugins.estimators.provider("grpo")
    assert info.distribution == "posttrain" and info.module == "posttrain.plugins.estimators.grpo"
    assert plugins.header().startswith("plugins: posttrain-")


def test_third_party_distribution_is_discovered(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "posttrain-shout", {"shout": "shout_mod"},
                      {"shout_mod": REWARD_PLUGIN.format(name="shout")})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = load_plugins()
    assert plugins.rewards.provider("shout").provided_by == "posttrain-shout==1.2.3"
    assert "posttrain-shout-1.2.3" in plugins.header()


def test_broken_plugin_is_reported_once_and_others_load(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "posttrain-broken", {"broken": "broken_mod", "shout": "shout_mod"},
                      {"broken_mod": "raise ImportError('needs libfoo')\n",
                       "shout_mod": REWARD_PLUGIN.format(name="shout")})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = load_plugins()
    assert [str(f) for f in plugins.failures] == [
        "plugin 'broken' from posttrain-broken failed to import: ImportError: needs libfoo "
        "(disable it with `-p no:broken`)"]
    assert "shout" in plugins.rewards and "grpo" in plugins.estimators
    assert "failed to import" in plugins.rewards.unknown_message("brokn")


def test_duplicate_names_name_both_providers(write):
    path = write("dup.py", REWARD_PLUGIN.format(name="exact_match"))
    with pytest.raises(PluginError) as info:
        load_plugins(plugin_files=[path])
    message = str(info.value)
    assert "reward 'exact_match' is registered twice" in message.replace("rewards", "reward")
    assert "posttrain==" in message and str(path) in message


def test_disabled_plugins_are_not_loaded():
    plugins = load_plugins(disabled=["grpo"])
    assert "grpo" not in plugins.estimators and "exact_match" in plugins.rewards


def test_autoload_off_keeps_builtins_and_named_plugins(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "posttrain-shout", {"shout": "shout_mod", "loud": "loud_mod"},
                      {"shout_mod": REWARD_PLUGIN.format(name="shout"), "loud_mod": REWARD_PLUGIN.format(name="loud")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins = load_plugins()
    assert "shout" not in plugins.rewards and "exact_match" in plugins.rewards
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "loud")
    plugins = load_plugins()
    assert "loud" in plugins.rewards and "shout" not in plugins.rewards


def test_misspelled_hook_is_caught(write):
    path = write("typo.py", "from posttrain import hookimpl\n\n@hookimpl\ndef posttrain_register_estimator(registry):\n    pass\n")
    with pytest.raises(PluginError, match="posttrain_register_estimator"):
        load_plugins(plugin_files=[path])


def test_plugin_file_errors_name_file_and_line(write, tmp_path):
    bad = write("bad_syntax.py", "x = 1\ndef f(:\n")
    with pytest.raises(PluginError, match=r"bad_syntax.py:2: syntax error"):
        load_plugins(plugin_files=[bad])
    boom = write("boom.py", "import os\nraise RuntimeError('nope')\n")
    with pytest.raises(PluginError, match=r"boom.py:2: RuntimeError: nope"):
        load_plugins(plugin_files=[boom])
    with pytest.raises(PluginError, match="no such file"):
        load_plugins(plugin_files=[tmp_path / "absent.py"])


def test_hook_that_raises_names_the_plugin(write):
    path = write("raiser.py", "from posttrain import hookimpl\n\n@hookimpl\ndef posttrain_register_rewards(registry):\n"
                              "    raise ValueError('bad registration')\n")
    with pytest.raises(PluginError, match="plugin 'raiser' failed in posttrain_register_rewards: ValueError"):
        load_plugins(plugin_files=[path])


def test_function_components_are_wrapped(write):
    path = write("gen.py", textwrap.dedent('''
        from posttrain import hookimpl

        async def echo(group, engine, sampling):
            """Returns the group unchanged."""
            return group

        @hookimpl
        def posttrain_register_generators(registry):
            registry.add(echo, name="echo")
    '''))
    cls = load_plugins(plugin_files=[path]).generators["echo"]
    import asyncio

    assert asyncio.run(cls(cls.Config())([1, 2], None, None)) == [1, 2]
    assert cls.__doc__ == "Returns the group unchanged."


def test_discovery_in_a_fresh_process(tmp_path):
    fake_distribution(tmp_path, "posttrain-shout", {"shout": "shout_mod"},
                      {"shout_mod": REWARD_PLUGIN.format(name="shout")})
    code = ("import json; from posttrain.core.plugins import load_plugins; p = load_plugins(); "
            "print(json.dumps({'rewards': sorted(p.rewards), 'dist': p.rewards.provider('shout').distribution}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    data = json.loads(out.stdout)
    assert "shout" in data["rewards"] and "exact_match" in data["rewards"]
    assert data["dist"] == "posttrain-shout"
