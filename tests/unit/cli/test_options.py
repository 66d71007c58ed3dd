"""``-p`` as in pytest: ``-p NAME`` loads a plugin, ``-p no:NAME`` and ``--disable-plugin NAME`` disable it."""

import json
import subprocess
import sys

from posttrain.cli.options import _argv_disable_plugin, split_specs

from tests.conftest import env_with


def test_specs_split_into_loaded_and_disabled():
    assert split_specs(["no:grpo", "my_mod", "no:math"]) == (["my_mod"], ["grpo", "math"])
    assert _argv_disable_plugin(["plugins", "list", "--disable-plugin", "grpo", "--disable-plugin=math", "-p", "x"]) \
        == ["plugins", "list", "-p", "no:grpo", "-p", "no:math", "-p", "x"]


def test_p_name_loads_a_module_and_no_name_disables(tmp_path):
    (tmp_path / "my_scorer.py").write_text("""
from posttrain import hookimpl

class Scorer:
    name = "my_scorer"
    def __init__(self, config=None):
        self.config = config
    def __call__(self, sample):
        return 1.0

@hookimpl
def posttrain_register_rewards(registry):
    registry.add(Scorer)
""")

    def names(*args):
        out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "plugins", "list", "--json", *args],
                             capture_output=True, text=True, env=env_with(tmp_path))
        assert out.returncode == 0, out.stderr
        return {r["name"] for r in json.loads(out.stdout)}

    assert "my_scorer" not in names()
    assert "my_scorer" in names("-p", "my_scorer")
    listed = names("-p", "my_scorer", "-p", "no:grpo", "--disable-plugin", "rloo")
    assert "my_scorer" in listed and "grpo" not in listed and "rloo" not in listed
    bad = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "plugins", "list", "-p", "no_such_mod"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "-p no_such_mod: no installed plugin or importable module" in bad.stderr
