"""The docs site builds with ``mkdocs build --strict`` (a broken link, a nav entry without a page or a
docstring mkdocstrings cannot read fails), and its references are generated from the code: every run-config
key, every hook, every built-in component and every command is on its page."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def page(site, name):
    return (site / name / "index.html").read_text()


def test_config_reference_has_every_key(site):
    from posttrain.cli.config_cmd import sections

    text = page(site, "reference/config")
    for section in sections():
        for row in section.rows:
            assert f"<code>{row['name']}</code>" in text, f"{section.name}.{row['name']}"
    assert "num_rollouts" in text and "<!-- generated" not in text
    # generated, not written: the source page holds the marker and no key
    source = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert "<!-- generated: config -->" in source and "max_new_tokens" not in source


def test_hook_reference_has_every_hook(site):
    import posttrain.core.hookspecs as hookspecs

    text = page(site, "reference/hooks")
    hooks = [n for n in dir(hookspecs) if n.startswith("posttrain_")]
    assert len(hooks) >= 10
    for name in hooks:
        assert f'id="posttrain.core.hookspecs.{name}"' in text, name
    assert "::: posttrain.core.hookspecs" in (ROOT / "docs" / "reference" / "hooks.md").read_text()


def test_components_and_commands_are_listed(site):
    from posttrain.core.plugins import load_plugins

    text = page(site, "reference/components")
    plugins = load_plugins(autoload=False)
    for name in ("grpo", "ppo_clip", "math", "nonzero_std", "single_turn", "qwen3", "local", "megatron", "sft"):
        assert re.search(rf'<h3 id="{name}"', text), name
    assert len(re.findall(r"<h3 ", text)) == sum(len(r) for r in plugins.registries().values())
    cli = page(site, "reference/cli")
    for command in ("rl-cli run", "rl-cli models export", "rl-cli config show", "rl-cli engine serve"):
        assert f"<code>{command}</code>" in cli, command
    assert "Benchmark" in page(site, "benchmarks") and "bench/e2e.py" in page(site, "benchmarks")


def test_no_page_shows_a_raw_sphinx_role(site):
    """Docstrings' ``:class:`X``` and the like (docs/hooks/sphinx_roles.py) render as links or code, never as
    the role's text; a target the site documents is a link to it."""
    raw = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):(?:<code>|`)")
    found = {str(p.relative_to(site)): raw.findall(p.read_text()) for p in site.rglob("*.html")}
    assert not {name: hits for name, hits in found.items() if hits}
    text = page(site, "reference/interfaces")
    assert 'href="#posttrain.core.interfaces.EstimatorNeeds"><code>EstimatorNeeds</code></a>' in text
    assert 'href="#posttrain.core.types.SamplingParams.to_sglang"><code>to_sglang()</code></a>' in text
