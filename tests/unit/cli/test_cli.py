import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, env_with

EXAMPLE = ROOT / "examples" / "plugin-package"


def rl_cli(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def example_site(pip_target):
    return pip_target(EXAMPLE)


def test_plugins_list_json_has_builtins_with_provenance():
    out = rl_cli("plugins", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)}
    assert rows[("estimator", "grpo")]["distribution"] == "posttrain"
    assert rows[("reward", "exact_match")]["module"] == "posttrain.plugins.rewards.exact_match"
    assert set(next(iter(rows.values()))) == {"kind", "name", "distribution", "version", "module", "summary"}


def test_plugins_list_filters_by_kind():
    out = rl_cli("plugins", "list", "--json", "--kind", "reward")
    assert {r["kind"] for r in json.loads(out.stdout)} == {"reward"}
    bad = rl_cli("plugins", "list", "--kind", "rewrd")
    assert bad.returncode == 2 and "Did you mean 'reward'?" in bad.stderr


def test_installed_third_party_package_is_listed_and_usable(example_site, write):
    env = env_with(example_site)
    rows = {r["name"]: r for r in json.loads(rl_cli("plugins", "list", "--json", env=env).stdout)}
    assert rows["keyword"]["distribution"] == "posttrain-example" and rows["keyword"]["version"] == "0.2.0"
    assert rows["signed"]["kind"] == "estimator"
    write("p.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n')
    cfg = write("ex.yaml", "estimator: {name: signed, scale: 2.0}\nrewards: [{name: keyword, keywords: [a]}]\n"
                           "rollout: {rollout_batch_size: 2, n_samples_per_prompt: 4, num_rollouts: 1}\n"
                           "trainer: {global_batch_size: 8, micro_batch_size: 4}\ndata: {path: p.jsonl}\n"
                           "model: {name: qwen3, tokenizer: char}\ngenerator: single_turn\nloss: ppo_clip\n")
    out = rl_cli("run", cfg, "--dry-run", env=env)
    assert out.returncode == 0, out.stderr
    assert "posttrain-example-0.2.0" in out.stdout and "scale: 2.0" in out.stdout


def test_example_package_passes_its_contract_tests(example_site):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                         capture_output=True, text=True, env=env_with(example_site), cwd=EXAMPLE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout


def test_our_parametrized_unit_tests_pass_with_a_third_party_plugin_installed(example_site):
    """The tests over every registered component use posttrain's own plugins: an installed package (the
    example's `signed` estimator and `keyword` reward) neither adds cases nor breaks exact-message checks."""
    tests = [str(ROOT / "tests" / "unit" / path) for path in ("plugins/estimators/test_estimators.py", "core/test_losses.py")]
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *tests, "-k",
            "wrong_shapes or non_finite or name_the_tensor"]
    listed = subprocess.run([*args, "--collect-only", "-q"], capture_output=True, text=True,
                            env=env_with(example_site), cwd=ROOT)
    assert "[grpo" in listed.stdout and "signed" not in listed.stdout, listed.stdout[-2000:]
    out = subprocess.run([*args, "-q"], capture_output=True, text=True, env=env_with(example_site), cwd=ROOT)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:]


def test_plugins_show():
    out = rl_cli("plugins", "show", "grpo")
    assert out.returncode == 0
    assert "Group Relative Policy Optimization" in out.stdout and "normalize_std" in out.stdout
    bad = rl_cli("plugins", "show", "grpoo")
    assert bad.returncode == 2 and "Did you mean 'grpo'?" in bad.stderr


def test_plugins_check_runs_the_contract():
    out = rl_cli("plugins", "check", "grpo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout


def test_plugins_check_runs_the_backend_contracts():
    out = rl_cli("plugins", "check", "external")  # its server checks skip: no URLs configured
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "no contract suite" not in out.stdout


def test_plugins_check_fails_a_broken_component(write):
    path = write("bad_est.py", '''
from dataclasses import dataclass
from posttrain import hookimpl

class Leaky:
    """Ignores the mask (a contract violation)."""
    name = "leaky"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
    def advantages(self, batch):
        import torch
        out = torch.ones_like(batch.response_mask)
        return out, out

@hookimpl
def posttrain_register_estimators(registry):
    registry.add(Leaky)
''')
    out = rl_cli("plugins", "check", "leaky", "--plugin", path)
    assert out.returncode == 1
    assert "test_shapes_finite_and_zero_outside_mask" in out.stdout


def test_plugins_check_runs_the_rules_our_own_tests_keep(write):
    """An estimator that passed `plugins check` before issue #20 and failed posttrain's own unit tests:
    masked, finite, but NaN rewards pass through as 0, token_rewards are ignored, shapes go unchecked."""
    path = write("lax_est.py", '''
from dataclasses import dataclass
from posttrain import hookimpl

class Lax:
    """Group-centred rewards with nan_to_num: no error for NaN, token_rewards ignored."""
    name = "lax"
    @dataclass
    class Config:
        pass
    def __init__(self, config=None):
        self.config = config
    def advantages(self, batch):
        import torch
        _, inverse = torch.unique(batch.group_index, return_inverse=True)
        r = torch.nan_to_num(batch.rewards.float(), nan=0.0, posinf=0.0)
        n = int(inverse.max()) + 1
        mean = torch.zeros(n).index_add_(0, inverse, r) / torch.zeros(n).index_add_(0, inverse, torch.ones_like(r))
        adv = (r - mean[inverse[: len(r)]]).unsqueeze(-1)[: batch.response_mask.shape[0]] * batch.response_mask
        return adv, adv.clone()

@hookimpl
def posttrain_register_estimators(registry):
    registry.add(Lax)
''')
    out = rl_cli("plugins", "check", "lax", "--plugin", path)
    assert out.returncode == 1, out.stdout
    for rule in ("test_non_finite_reward_raises_naming_the_sample", "test_nan_token_reward_on_a_response_token_raises",
                 "test_token_rewards_are_never_silently_ignored", "test_wrong_shapes_raise_a_clear_error"):
        assert f"{rule}" in out.stdout and "FAILED" in out.stdout, rule
    assert "test_shapes_finite_and_zero_outside_mask" not in out.stdout  # the rest of the contract holds


def test_every_kind_with_a_contract_has_a_scaffold_that_states_its_rules(tmp_path):
    from posttrain.cli.new import BODIES
    from posttrain.core.registry import KINDS
    from posttrain.testing import CONTRACTS

    assert {KINDS[plural] for plural in CONTRACTS} <= set(BODIES)
    for kind in ("loss", "filter"):
        out = rl_cli("new", "plugin", tmp_path / kind, "--kind", kind, "--name", f"my_{kind}")
        assert out.returncode == 0, out.stderr
        module = (tmp_path / kind / f"posttrain_my_{kind}" / "__init__.py").read_text()
        contract = {"loss": "LossContract", "filter": "FilterContract"}[kind]
        assert f"The rules posttrain's {contract} checks" in module
    assert "inputs of different shapes raise ``ValueError``" in (tmp_path / "loss" / "posttrain_my_loss" /
                                                                  "__init__.py").read_text()


def test_dry_run_reports_five_errors_without_traceback(write):
    cfg = write("bad.yaml", "estimator: {name: grop}\nrewards: [{name: exact_match, ignore_cse: true}]\n"
                            "rollout: {rollout_batch_size: -3}\ntrainer: {lrr: 1}\ndata: {path: missing.jsonl}\n"
                            "model: qwen3\ngenerator: single_turn\nloss: ppo_clip\n")
    out = rl_cli("run", cfg, "--dry-run")
    assert out.returncode == 2
    assert "5 error(s)" in out.stderr and "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("  ")]) == 5
    debug = rl_cli("--debug", "run", cfg, "--dry-run")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_dry_run_prints_header_and_resolved_config():
    out = rl_cli("run", ROOT / "examples" / "quickstart.yaml", "--dry-run", "estimator.epsilon=1e-3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("plugins: posttrain-")
    assert "epsilon: 0.001" in out.stdout


def test_disable_plugin_flag():
    out = rl_cli("plugins", "list", "--json", "-p", "no:grpo")
    assert "grpo" not in {r["name"] for r in json.loads(out.stdout)}


def test_cli_imports_nothing_heavy():
    code = ("import sys; from posttrain.cli.main import main\n"
            "for argv in (['rl-cli', '--help'], ['rl-cli', 'plugins', 'list']):\n"
            "    sys.argv = argv\n"
            "    try:\n        main()\n    except SystemExit:\n        pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'ray', 'sglang', 'transformers'})\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr


SCAFFOLD_KINDS = ["estimator", "loss", "correction", "generator", "filter", "model", "engine", "trainer"]
# reward: tests/unit/cli/test_new.py installs that scaffold offline and runs its check


@pytest.mark.slow
def test_new_plugin_passes_its_own_tests(tmp_path):
    # every kind's scaffold, installed together (one pip call), listed, and its own tests run (one pytest)
    pkgs = [tmp_path / f"my-{kind}" for kind in SCAFFOLD_KINDS]
    for kind, pkg in zip(SCAFFOLD_KINDS, pkgs):
        out = rl_cli("new", "plugin", pkg, "--kind", kind, "--name", f"my_{kind}")
        assert out.returncode == 0, out.stderr
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), *map(str, pkgs)], check=True, capture_output=True)
    listed = {r["name"]: r for r in json.loads(rl_cli("plugins", "list", "--json", env=env_with(site)).stdout)}
    assert {k: listed[f"my_{k}"]["distribution"] for k in SCAFFOLD_KINDS} == {
        k: f"posttrain-my-{k}" for k in SCAFFOLD_KINDS}
    test = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--import-mode=importlib",
                           "--rootdir", str(tmp_path), *(str(pkg / "tests") for pkg in pkgs)],
                          capture_output=True, text=True, env=env_with(site), cwd=tmp_path)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-2000:]
    passed = {line.split("/")[0] for line in test.stdout.splitlines() if " PASSED" in line}
    assert passed == {pkg.name for pkg in pkgs}, test.stdout[-3000:]


def test_new_plugin_rejects_bad_input(tmp_path):
    out = rl_cli("new", "plugin", tmp_path / "x", "--kind", "estimatr", "--name", "ok")
    assert out.returncode == 2 and "Did you mean 'estimator'?" in out.stderr
    out = rl_cli("new", "plugin", tmp_path / "x", "--kind", "reward", "--name", "Bad-Name")
    assert out.returncode == 2 and "lower-case" in out.stderr


def test_the_contract_kits_runner_is_installed_with_posttrain():
    # `rl-cli new plugin` writes tests and `rl-cli plugins check` runs them with pytest: a plain
    # `pip install posttrain` (no extra) must bring it, or both fail for a new user
    from importlib.metadata import requires

    base = [r for r in requires("posttrain") if "extra ==" not in r]
    assert any(r.split(">")[0].split("=")[0].strip() == "pytest" for r in base), base
