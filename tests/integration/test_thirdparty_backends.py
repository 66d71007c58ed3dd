"""Backends are plugins: a third-party package (``tests/plugins/posttrain-thirdparty``, pip-installed into a
folder on PYTHONPATH) brings an engine backend (``hf_generate``: HF transformers behind SGLang's protocol)
and a trainer backend (``torch_simple``: plain PyTorch), and ``rl-cli run`` uses them when the config
names them, with no core file naming them."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, env_with

pytestmark = pytest.mark.slow
PACKAGE = ROOT / "tests" / "plugins" / "posttrain-thirdparty"
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["rollout.num_rollouts=3", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
         "trainer.global_batch_size=32", "trainer.micro_batch_size=32"]
HF_ENGINE = ["rollout.engine.name=hf_generate", "rollout.weight_sync=disk"]
TORCH_TRAINER = ["trainer.backend.name=torch_simple"]


@pytest.fixture(scope="module")
def site(pip_target):
    return pip_target(PACKAGE)


def rl_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=env)


def run_quickstart(tmp_path, site, *overrides):
    run = tmp_path / "run"
    out = rl_cli("run", QUICKSTART, "--run-dir", run, *SMALL, "trainer.log_kl=true", *overrides, env=env_with(site))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # the engine serves exactly the weights the trainer has: each step's push reached it
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r["train_rollout_logprob_abs_diff"]
        assert r["rollout/staleness_max"] == 0
    assert rows[0]["train/ref_policy_logprob_abs_diff"] == 0.0 < rows[2]["train/ref_policy_logprob_abs_diff"]
    loaded = {p["name"]: p["distribution"] for p in json.loads((run / "plugins.json").read_text())}
    assert loaded["hf_generate"] == loaded["torch_simple"] == "posttrain-thirdparty"
    return run, rows


def selected(run):
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    return config["rollout"]["engine"]["name"], config["trainer"]["backend"]["name"]


def test_core_names_no_third_party_backend():
    for path in (ROOT / "posttrain").rglob("*.py"):
        text = path.read_text()
        assert "hf_generate" not in text and "torch_simple" not in text, f"{path} names a third-party backend"


def test_listed_and_config_mistakes_caught_before_start(site):
    env = env_with(site)
    rows = {r["name"]: r for r in json.loads(rl_cli("plugins", "list", "--json", "--kind", "engine", env=env).stdout)}
    assert {"local", "sglang", "external", "hf_generate"} <= set(rows)
    assert rows["hf_generate"]["distribution"] == "posttrain-thirdparty"
    for override, error in (("rollout.weight_sync=tensor", "rollout.weight_sync: engine backend 'hf_generate' "
                                                           "supports disk, not tensor"),
                            ("trainer.backend.device=tpu", "trainer.backend.device: expected auto, cpu, cuda or "
                                                           "cuda:N, got 'tpu'")):
        out = rl_cli("run", QUICKSTART, "--dry-run", "rollout.engine.name=hf_generate",
                     "trainer.backend.name=torch_simple", override, env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr and error in out.stderr, out.stderr
    assert rl_cli("run", QUICKSTART, "--dry-run", "rollout.engine.name=hf_generate", env=env).returncode == 0


def test_hf_generate_engine_with_the_megatron_trainer(tmp_path, site):
    """weight_sync: auto resolves to disk, the one mode hf_generate's servers have."""
    run, _ = run_quickstart(tmp_path, site, "rollout.engine.name=hf_generate")
    assert selected(run) == ("hf_generate", "megatron")
    assert "hf_generate serving" in (run / "logs" / "engine-0.log").read_text()


def test_torch_simple_trainer_with_the_local_engine(tmp_path, site):
    """Weights reach posttrain's local engine over the Gloo weight-update group (weight_sync: distributed)."""
    run, _ = run_quickstart(tmp_path, site, *TORCH_TRAINER)
    assert selected(run) == ("local", "torch_simple")


def test_both_third_party_backends_and_a_checkpoint(tmp_path, site):
    run, rows = run_quickstart(tmp_path, site, *HF_ENGINE, *TORCH_TRAINER, "checkpoint.interval=3")
    assert selected(run) == ("hf_generate", "torch_simple")
    assert (run / "checkpoints" / "step_000003" / "trainer" / "policy" / "trainer.pt").is_file()
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_its_contract_suites_pass(site):
    """The package's own tests: EngineContract over hf_generate, TrainerContract over torch_simple."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PACKAGE / "tests")],
                         capture_output=True, text=True, env=env_with(site, OMP_NUM_THREADS="1"), cwd=PACKAGE)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout and "skipped" not in out.stdout, out.stdout[-1000:]
