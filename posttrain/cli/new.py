"""``rl-cli new plugin DIR --kind K --name N``: scaffold an installable plugin package that passes its tests."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from posttrain.cli.console import console
from posttrain.core.errors import UsageError, unknown

app = typer.Typer(help="Scaffold new plugins.", no_args_is_help=True)

# kind -> (registration hook, contract, fixture, class body)
BODIES = {
    "estimator": ("posttrain_register_estimators", "EstimatorContract", "estimator", '''
    group_baseline = True  # needs = EstimatorNeeds(critic=True, ...) asks the loop for more than rewards

    @dataclass
    class Config:
        scale: float = option(1.0, gt=0.0, help="multiplies the centred reward")

    def advantages(self, batch):
        """``batch.rewards [B]`` (plus each sample's summed ``token_rewards``) -> advantages and returns
        ``[B, T]``: the group-centred score on every response token, 0 outside ``response_mask``."""
        from posttrain.core.group_stats import group_mean_std, sequence_scores

        scores = sequence_scores(batch)  # checks shapes and NaN (ValueError naming the sample), adds token_rewards
        mean, _ = group_mean_std(scores, batch.group_index)
        adv = (self.config.scale * (scores - mean)).unsqueeze(-1) * batch.response_mask
        return adv, adv.clone()
'''),
    "reward": ("posttrain_register_rewards", "RewardContract", "reward", '''
    scope = "sample"

    @dataclass
    class Config:
        ignore_case: bool = option(True, help="compare case-insensitively")

    def __call__(self, sample):
        """``{"score": 1.0}`` when the label appears in the response, else 0.0."""
        response, label = sample.response, str(sample.label)
        if self.config.ignore_case:
            response, label = response.lower(), label.lower()
        return {"score": float(label in response)}
'''),
    "generator": ("posttrain_register_generators", "GeneratorContract", "generator", '''
    @dataclass
    class Config:
        max_new_tokens: int = option(64, ge=1, help="tokens to generate per sample")

    async def __call__(self, group, engine, sampling):
        """One ``/generate`` per sample, token in and token out; returns the completed samples."""
        from posttrain.core.rollout.client import tokens_and_logprobs, weight_version_int
        from posttrain.core.rollout.samples import engine_tokenizer, fill, finish_type, prompt_ids

        tokenizer = await engine_tokenizer(engine)
        for sample in group:  # for_sample: the run's sampling seed, if any, per sample
            params = {**sampling.for_sample(sample), "max_new_tokens": self.config.max_new_tokens}
            prompt = prompt_ids(sample, tokenizer)
            out = await engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
            ids, logprobs = tokens_and_logprobs(out)
            fill(sample, prompt, ids, [1] * len(ids), logprobs, out["text"], finish_type(out), weight_version_int(out))
        return group
'''),
    "loss": ("posttrain_register_losses", "LossContract", "loss", '''
    # PolicyLoss does the shape checks, padding, is_weights, aggregation and the standard metrics;
    # token_losses is the part that is yours.
    @dataclass
    class Config:
        aggregation: AggregationMode = option("token-mean", help="how per-token losses become one scalar")
        max_response_len: int | None = option(None, ge=1, help="normalizer of seq-mean-token-sum-norm")
        clip: float = option(0.2, gt=0.0, help="the ratio is clipped to [1 - clip, 1 + clip]")

    def token_losses(self, log_probs, old_log_probs, advantages, mask):
        """``(per-token loss, ratio, {flag: bool [B, T]})``, all ``[B, T]``: PPO's clipped surrogate
        ``-min(r A, clip(r, 1 - clip, 1 + clip) A)`` with ``r = exp(logp - logp_old)``."""
        import torch

        from posttrain.core.losses import clamped_log_ratio

        ratio = clamped_log_ratio(log_probs, old_log_probs).exp()
        clipped = ratio.clamp(1 - self.config.clip, 1 + self.config.clip)
        loss = -torch.minimum(ratio * advantages, clipped * advantages)
        return loss, ratio, {"clipfrac": ratio * advantages > clipped * advantages}
'''),
    "correction": ("posttrain_register_corrections", "CorrectionContract", "correction", '''
    @dataclass
    class Config:
        high: float = option(2.0, gt=0.0, help="weights above this are truncated to it")

    def __call__(self, train_log_probs, rollout_log_probs, response_mask):
        """``(is_weights, metrics)``: ``w = min(exp(logp_train - logp_rollout), high)`` per token, ``[B, T]``,
        0 outside ``response_mask``, without gradient."""
        import torch

        from posttrain.core.losses import clamped_log_ratio, mismatch_metrics

        with torch.no_grad():
            mask = response_mask.to(train_log_probs.dtype)
            ratio = clamped_log_ratio(train_log_probs.detach(), rollout_log_probs.detach()).exp()
            weights = torch.where(mask > 0, ratio.clamp(max=self.config.high), 0.0)
            clipped = ratio > self.config.high
            metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, weights,
                                       torch.zeros_like(clipped), clipped)
        return weights, metrics
'''),
    "filter": ("posttrain_register_filters", "FilterContract", "filter_", '''
    @dataclass
    class Config:
        min_scored: int = option(2, ge=1, help="keep groups with at least this many scored samples")

    def __call__(self, group):
        """``None`` keeps the rewarded group; a short reason (a metric name part) drops it."""
        scored = [s.reward for s in group if s.reward is not None]  # failed samples have no reward
        if len(scored) < self.config.min_scored:
            return "too_few_scored"
        return None if max(scored) > min(scored) else "equal_rewards"
'''),
    "model": ("posttrain_register_models", "ModelSpecContract", "model_spec", '''
    # A Llama-layout family: DenseGPTSpec maps HF <-> Megatron (fused QKV per query group, fused
    # gate/up); override transformer_config / layer_spec / the mapping methods where yours differs.
    model_types = ("llama",)
    hf_architecture = "LlamaForCausalLM"
    presets = {
        "tiny": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="float32"),
    }
'''),
    "engine": ("posttrain_register_engines", "EngineContract", "engine_backend", '''
    # The servers of this backend answer SGLang's HTTP API (/generate, /health_generate, /model_info,
    # /server_info, the weight-update endpoints of weight_sync_modes): posttrain's EngineContract checks it.
    weight_sync_modes = ("distributed", "tensor", "disk")

    @dataclass
    class Config:
        device: str = option("cpu", help="cpu | cuda")

    def on_gpu(self, resources):
        return self.config.device.startswith("cuda")

    def launch(self, slot):
        """Engine ``slot.index``'s server: argv and environment (the fleet starts, watches and restarts it).

        TODO: start your server here. This scaffold starts posttrain's own engine server on the checkpoint.
        Rule: the server requires the run's API key (``slot.api_key``, SGLang's ``Authorization: Bearer``)
        on every endpoint but ``/health*``; hand it over by environment, never on the command line."""
        import sys

        from posttrain.core.rollout.backend import API_KEY_ENV

        return EngineLaunch([sys.executable, "-m", "posttrain.cli.main", "engine", "serve", slot.model_path,
                             "--host", slot.host, "--port", str(slot.port), "--device", self.config.device],
                            env={"OMP_NUM_THREADS": "1", API_KEY_ENV: slot.api_key})
'''),
    "trainer": ("posttrain_register_trainers", "TrainerContract", "trainer_backend", '''
    @dataclass
    class Config:
        device: str = option("cpu", help="cpu | cuda | cuda:N")

    def on_gpu(self):
        return self.config.device.startswith("cuda")

    def build(self, spec, run, role="actor", seed=0):
        """The model of ``role`` (``actor`` or ``critic``) from the model spec and the run config: see
        ``{package}.model`` (imported here, so that this entry module stays light)."""
        from {package}.model import Model

        return Model(spec, run.trainer, device=self.config.device, seed=seed, role=role,
                     max_response_len=run.rollout.max_new_tokens)
'''),
}


# kinds whose scaffold builds on a posttrain base class (the class line and its import)
BASES = {"estimator": "(Estimator)", "reward": "(Component)", "generator": "(Component)", "correction": "(Component)",
         "filter": "(Component)", "loss": "(PolicyLoss)", "model": "(DenseGPTSpec)", "engine": "(EngineBackend)",
         "trainer": "(TrainerBackend)"}
IMPORTS = {"estimator": "from posttrain.api import Estimator\n",
           **dict.fromkeys(("reward", "generator", "correction", "filter"), "from posttrain.api import Component\n"),
           "loss": "from posttrain.core.losses import AggregationMode, PolicyLoss\n",
           "model": "from posttrain.plugins.trainers.megatron.spec import DenseGPTSpec\n",
           "engine": "from posttrain.api import EngineBackend, EngineLaunch\n",
           "trainer": "from posttrain.api import TrainerBackend\n"}
DOCS = {"engine": "TODO: one line on what runs behind SGLang's protocol, then where it runs and what it serves.",
        "trainer": "TODO: one line on how this backend trains (devices, parallelism, optimizer), then its limits."}
# kinds with a second module (the heavy part, imported on use), from a template next to this file
MODULES = {"trainer": ("model.py", "new_trainer_model.py.tmpl")}


@app.command()
def plugin(directory: Path = typer.Argument(..., help="where to create the package", show_default=False),
           kind: str = typer.Option(..., "--kind", help=" | ".join(BODIES),
                               show_default=False),
           name: str = typer.Option(..., "--name", help="the component name used in run configs", show_default=False),
           force: bool = typer.Option(False, "--force", help="write into a non-empty directory")) -> None:
    """Create an installable plugin package: pyproject with the entry point, module, contract test, README."""
    if kind not in BODIES:
        raise UsageError(f"--kind: {unknown('kind', kind, BODIES)}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise UsageError(f"--name: {name!r} must be lower-case letters, digits and underscores, starting with a letter")
    if directory.exists() and any(directory.iterdir()) and not force:
        raise UsageError(f"{directory}: directory exists and is not empty (use --force)")
    files = _files(kind, name)
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    console.print(f"created {directory}/ ({', '.join(files)})\nnext: {install_line(directory)} && pytest {directory}",
                  markup=False, highlight=False, soft_wrap=True)


def _files(kind: str, name: str) -> dict[str, str]:
    """The package's files (path relative to the package directory -> text) for a ``kind`` component ``name``."""
    package = f"posttrain_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    files = {"pyproject.toml": _pyproject(kind, name, package),
             f"{package}/__init__.py": _module(kind, name, package, cls),
             "tests/test_contract.py": _contract_test(kind, name, package, cls), "README.md": _readme(kind, name)}
    if kind in MODULES:
        module, template = MODULES[kind]
        files[f"{package}/{module}"] = (Path(__file__).with_name(template)).read_text().format(name=name)
    return files


def install_line(directory: Path | str) -> str:
    """The install command for a scaffolded package: into the environment posttrain is in, from what is
    installed there (no package index needed: ``--no-build-isolation`` builds with the environment's setuptools)."""
    return f"pip install --no-build-isolation -e {directory}[test]"


def _pyproject(kind: str, name: str, package: str) -> str:
    return f'''[build-system]
requires = ["setuptools>=64"]  # 64: editable installs (PEP 660)
build-backend = "setuptools.build_meta"

[project]
name = "posttrain-{name.replace('_', '-')}"
version = "0.1.0"
description = "A posttrain {kind} plugin: {name}"
requires-python = ">=3.11"
# posttrain is not listed: the plugin is installed into the environment posttrain runs in (see README.md),
# and no package index carries posttrain for pip to resolve. List the version you test against here
# (dependencies = ["posttrain>=0.1"]) once yours does.
dependencies = []

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.posttrain]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]
'''


def _module(kind: str, name: str, package: str, cls: str) -> str:
    """The entry module: the component class, its config, the hookimpl that registers it."""
    hook, contract, _, body = BODIES[kind]
    body = body.replace("{package}", package)
    return f'''"""posttrain plugin: the {kind} `{name}`.

The rules posttrain's {contract} checks (`pytest tests/`, and `rl-cli plugins check {name}` once
installed); posttrain's own {kind}s pass the same suite.

{_rules(contract)}
"""

from dataclasses import dataclass

from posttrain import hookimpl, option
{IMPORTS.get(kind, "")}

class {cls}{BASES.get(kind, "")}:
    """{DOCS.get(kind, f"TODO: one line on what this {kind} does, then the formula and tensor shapes.")}"""

    name = "{name}"
{body}

@hookimpl
def {hook}(registry):
    registry.add({cls})
'''


def _contract_test(kind: str, name: str, package: str, cls: str) -> str:
    """posttrain's contract suite on the component, and its discovery through the entry point."""
    _, contract, fixture, _ = BODIES[kind]
    return f'''import pytest

from posttrain.testing import {contract}
from {package} import {cls}


class Test{cls}({contract}):
    @pytest.fixture
    def {fixture}(self):
        return {cls}({cls}.Config())


def test_discovered_through_the_entry_point():
    from posttrain.core.plugins import load_plugins

    plugins = load_plugins()
    assert plugins.registry("{kind}")["{name}"] is {cls}
    assert plugins.registry("{kind}").provider("{name}").distribution == "posttrain-{name.replace('_', '-')}"
'''


def _readme(kind: str, name: str) -> str:
    return f'''# posttrain-{name.replace('_', '-')}

A posttrain {kind} plugin.

Install it into the environment posttrain is installed in (posttrain is not a dependency that pip resolves:
no package index carries it), then run posttrain's contract tests on it:

```bash
{install_line(".")} && pytest
rl-cli plugins check {name}
rl-cli plugins show {name}
```

Use it in a run config:

```yaml
{_yaml_snippet(kind, name)}
```
'''


def _rules(contract: str) -> str:
    """The contract module's docstring: the rules, from where the checks are (so they cannot drift apart)."""
    import importlib

    from posttrain.testing import _LAZY

    doc = importlib.import_module(f"posttrain.testing.contracts.{_LAZY[contract]}").__doc__ or ""
    return doc.strip().replace("\\", "\\\\").replace('"' * 3, "'" * 3)


def _yaml_snippet(kind: str, name: str) -> str:
    if kind == "reward":
        return f"rewards:\n  - name: {name}\n    weight: 1.0"
    if kind == "engine":
        return f"rollout:\n  engine:\n    name: {name}"
    if kind == "trainer":
        return f"trainer:\n  backend:\n    name: {name}"
    if kind == "filter":
        return f"filters:\n  - name: {name}"
    return f"{kind}:\n  name: {name}"
