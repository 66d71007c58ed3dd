"""The trained model comes out of a run (issue #20): every run ends with ``RUN_DIR/hf-final``, an HF
checkpoint of the final policy that ``transformers`` loads with the trainer's log-probs, and ``rl-cli
models export RUN_DIR [--step N] OUT`` writes the same from any of the run's checkpoints."""

import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=32",
         "trainer.micro_batch_size=32", "rollout.num_rollouts=2", "checkpoint.interval=1",
         "checkpoint.hf_init_weights=true"]  # the initial weights, to tell the trained ones from


def rl_cli(*args):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def tensors(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    out = rl_cli("run", QUICKSTART, "--run-dir", run, *SMALL)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"final model (HF checkpoint): {run / 'hf-final'}" in out.stdout
    return run


def test_run_ends_with_hf_final_that_transformers_loads_with_the_trainers_log_probs(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.run_dir import RunDirectory
    from posttrain.testing.contracts.trainer import contract_batch, valid_columns

    final = run / "hf-final"
    assert (final / "config.json").is_file() and AutoTokenizer.from_pretrained(final) is not None
    assert tensors(run / "hf-init"), "checkpoint.hf_init_weights: the initial weights are in hf-init"
    assert not same(tensors(final), tensors(run / "hf-init")), "hf-final must hold the trained weights"
    # the trainer as the run left it: its last checkpoint (after step 2) loaded into a fresh one
    trainer = TrainerRole(yaml.safe_load((run / "config.yaml").read_text()))
    trainer.load(str(RunDirectory(run).checkpoint_after(2) / "trainer"))
    batch = contract_batch()
    ours = trainer.log_probs(batch)
    hf = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch.tokens).logits.float()  # right padding: causal attention leaves the columns before it
    theirs = torch.zeros_like(ours)
    theirs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    valid = valid_columns(batch)
    assert (ours[valid] - theirs[valid]).abs().max() < 1e-4


def test_models_export_writes_any_steps_checkpoint(run, tmp_path):
    latest, first = tmp_path / "latest", tmp_path / "first"
    out = rl_cli("models", "export", run, latest)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 steps" in out.stdout
    assert "Warning" not in out.stderr, out.stderr  # torch's deprecation notes about the checkpoint format
    assert same(tensors(latest), tensors(run / "hf-final")), "the last checkpoint's export is hf-final"
    assert (latest / "tokenizer.json").is_file()
    assert rl_cli("models", "export", run, "--step", 1, first).returncode == 0
    assert not same(tensors(first), tensors(latest)) and not same(tensors(first), tensors(run / "hf-init"))
    missing = rl_cli("models", "export", run, "--step", 7, tmp_path / "none")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "--step 7: no checkpoint after 7 steps" in missing.stderr and "1 (step_000001), 2 (step_000002)" in missing.stderr
