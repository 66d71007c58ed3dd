"""The ``local`` engine backend: posttrain's own engine server (``rl-cli engine serve``) over an HF
checkpoint, one process per engine, on the CPU or one GPU each.

Modules (none imported here: this entry module stays light):

- ``server``: the HTTP server speaking SGLang's native API (generate, abort, pause, weight updates by
  disk, Gloo/NCCL group or CUDA IPC, memory release for colocation);
- ``engine``: continuous batching in one thread (``overlap``: step N + 1 launched before step N lands);
  ``model_runner``: the forward passes over a static slot KV cache (CUDA graphs on GPU), with the decoder
  layer's parts in ``layers`` and the decode attention in ``attention``; ``decode_kernel``: the Triton
  flash-decoding kernel; ``sampling``: per-row sampling (temperature, top-p/k, min-p, seeds), and
  ``sampling_kernel`` its one-pass Triton kernel for uniform batches; ``memory``: release/resume;
- ``command``: the ``rl-cli engine serve`` command, added through ``posttrain_register_commands``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields, replace
from typing import Any

from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot
from posttrain.plugins.engines.local.options import EngineOptions

MODEL_WAIT_S = 3600  # how long a server launched before its checkpoint waits for it (a trainer's build and save)
# HF architectures whose decoder layer the model runner knows (layers.project_qkv/finish_layer)
SERVED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Glm4ForCausalLM",
                        "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")


class LocalEngine(EngineBackend):
    """posttrain's own engine server: SGLang's HTTP API, continuous batching over a static KV cache.

    For CPU machines, tests and single-GPU runs (Triton flash-decoding and CUDA graphs on GPU). Serves
    the architectures in ``SERVED_ARCHITECTURES``; a model spec of another architecture is refused
    before start. On ``device: cuda`` engine ``i`` takes GPU ``first + i x gpus_per_engine`` (``first``:
    0 when colocated, else ``resources.trainer_gpus_per_node``); ``cuda:N`` puts every engine on GPU N.
    Each engine sees its GPU alone (``CUDA_VISIBLE_DEVICES``).
    """

    name = "local"
    is_default = True  # a run config without rollout.engine runs this
    seeds_batch_rows = True
    flat_weight_buckets = True
    merges_adapters = True  # LoRA pushes: adapter pairs merged from each weight's kept base
    waits_for_checkpoint = True  # rl-cli engine serve --wait-for-model: imports torch and transformers meanwhile
    starts_without_weights = True  # rl-cli engine serve --load-format dummy: the model built from config.json
    exact_mode = True  # rollout.exact: exact_mode.py, with the megatron trainer's arithmetic

    Config = EngineOptions

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []
        arch = getattr(plugins.models.get(run.model.name), "hf_architecture", "") if run.model else ""
        if arch and arch not in SERVED_ARCHITECTURES:
            errors.append(f"rollout.engine: the local engine cannot serve {arch} (model {run.model.name!r}); it "
                          f"serves {', '.join(SERVED_ARCHITECTURES)}. Use rollout.engine.name: sglang")
        if _vision_language(run, plugins):
            errors.append("rollout.engine: the local engine serves text models only, not a vision-language model or "
                          "images (data.images_key); use rollout.engine.name: hf (or sglang)")
        return errors

    def on_gpu(self, resources: Any) -> bool:
        return self.config.device.startswith("cuda")

    def engine_gpus(self, resources: Any) -> list[int]:
        device = self.config.device
        if device.startswith("cuda:"):  # every engine on that GPU
            return [int(device[5:])]
        return super().engine_gpus(resources)

    def serve_command(self, model_dir: str, port: int, host: str = "127.0.0.1", **server_options: Any) -> list[str]:
        """The ``rl-cli engine serve`` argv of ``model_dir`` on ``host:port`` with this backend's config as it is
        (a test's or a tool's engine; a run's goes through :meth:`launch`, which places it on its GPU);
        ``server_options``: :func:`local_engine_command`'s."""
        return local_engine_command(model_dir, port, self.config, host=host, **server_options)

    def launch(self, slot: EngineSlot) -> EngineLaunch:
        from posttrain.core.rollout.backend import API_KEY_ENV, gpu_ids
        from posttrain.core.rollout.fleet import visible_device

        device, env = self.config.device, {API_KEY_ENV: slot.api_key}
        if device == "cuda":
            device = f"cuda:{gpu_ids(slot.resources, slot.index)[0]}"
        if device.startswith("cuda:"):  # the engine sees its GPU alone, as cuda:0, in every thread
            env["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":")[1]))
            device = "cuda"
        cfg = self.config
        # a GPU engine compiles and captures its decode step for the run's sampling before it answers: a disaggregated
        # run's engines do so while the trainer builds, not in the first rollout. Not where a colocated engine's
        # release would drop the graphs (no stable memory): its first rollout would capture them again.
        warm = (cfg.warm_up and device == "cuda" and slot.sampling is not None
                and (cfg.stable_memory or not slot.resources.colocate))
        # stable memory serves the releases of colocated engines alone
        served = replace(cfg, device=device, warm_up=warm, exact=cfg.exact or slot.exact,
                         stable_memory=device == "cuda" and cfg.stable_memory and slot.resources.colocate)
        return EngineLaunch(local_engine_command(
            slot.model_path, slot.port, served, host=slot.host,
            wait_for_model=MODEL_WAIT_S if slot.model_pending else None,
            load_format="dummy" if slot.weights_from_push else None,
            warm_sampling=json.dumps(slot.sampling) if warm else None), env)


def _vision_language(run: Any, plugins: Any) -> bool:
    """Whether the run has images (``data.images_key``) or its model's config describes a vision tower."""
    if getattr(getattr(run, "data", None), "images_key", None):
        return True
    if not run.model:
        return False
    from posttrain.core.vision import is_vision_config

    try:
        return is_vision_config(run.model.create(plugins).hf_config())
    except Exception:  # noqa: BLE001 - an unreadable model config is the model section's error
        return False


def config_flags(config: Any) -> list[str]:
    """``config``'s fields as ``rl-cli engine serve`` flags, every one of them (``engine serve`` rebuilds
    :class:`LocalEngine.Config` from them through the same schema): ``--name value``, a bool as ``--name`` or
    ``--no-name``."""
    argv = []
    for f in fields(config):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def local_engine_command(model_dir: str, port: int, config: Any = None, host: str = "127.0.0.1",
                         **options: Any) -> list[str]:
    """The ``rl-cli engine serve`` argv (run through this interpreter) for the local engine: ``config`` (a
    :class:`LocalEngine.Config`; None: the defaults) whole, then the server's own ``options`` (``port``-like
    flags by name: ``wait_for_model``, ``load_format``, ``warm_sampling``, ``no_api_key``; None or False: left
    out)."""
    cmd = [sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(model_dir), "--host", host,
           "--port", str(port), *config_flags(config if config is not None else LocalEngine.Config())]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (None, False):
            cmd += [flag, str(value)]
    return cmd


@hookimpl
def posttrain_register_engines(registry):
    registry.add(LocalEngine)


@hookimpl
def posttrain_register_commands(app):
    from posttrain.plugins.engines.local.command import app as engine_app

    app.add_typer(engine_app, name="engine")
