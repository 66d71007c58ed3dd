"""``rl-cli new plugin``'s package installs where posttrain is installed with no package index (posttrain is
not a dependency for pip to resolve: no index carries it), and then passes its tests and ``plugins check``."""

import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

from tests.conftest import ROOT


def rl_cli(*args, python=sys.executable, env=None):
    return subprocess.run([str(python), "-m", "posttrain.cli.main", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def environment_over_this_one(path: Path) -> Path:
    """A virtual environment of its own (pip installs into it) that sees this one's packages (posttrain,
    pytest, setuptools) as installed: its site-packages adds this one's after its own. Returns its python."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    outer = sysconfig.get_paths()["purelib"]
    Path(own, "_outer_site.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    return python


def offline_env() -> dict:
    """No package index, no local wheel folders, no pip config: only what is installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.mark.parametrize("kind", ["estimator", "loss", "correction", "reward", "generator", "filter", "model",
                                  "engine", "trainer"])
def test_the_scaffolds_pyproject_needs_nothing_an_index_must_serve(kind):
    from posttrain.cli.new import _files

    project = tomllib.loads(_files(kind, f"my_{kind}")["pyproject.toml"])
    assert project["project"]["dependencies"] == []  # posttrain comes from the environment
    assert project["project"]["optional-dependencies"]["test"] == ["pytest>=8"]  # installed with posttrain
    assert project["project"]["entry-points"]["posttrain"] == {f"my_{kind}": f"posttrain_my_{kind}"}


def test_a_scaffold_installs_offline_into_posttrains_environment_and_passes_its_checks(tmp_path):
    pkg = tmp_path / "my-reward"
    out = rl_cli("new", "plugin", pkg, "--kind", "reward", "--name", "my_reward")
    assert out.returncode == 0, out.stderr
    hint = f"next: pip install --no-build-isolation -e {pkg}[test] && pytest {pkg}"
    assert hint in out.stdout, out.stdout  # the [test] extra printed as written, not eaten as markup
    python = environment_over_this_one(tmp_path / "env")
    env = offline_env()
    install = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "-e", f"{pkg}[test]"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    assert "Successfully installed posttrain-my-reward-0.1.0" in install.stdout
    tests = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "tests"],
                           capture_output=True, text=True, env=env, cwd=pkg, timeout=300)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:] + tests.stderr[-2000:]
    check = rl_cli("plugins", "check", "my_reward", python=python, env=env)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    # installed in that environment only: this one does not list it
    assert "my_reward" not in rl_cli("plugins", "list").stdout
