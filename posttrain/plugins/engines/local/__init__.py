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
from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot
from posttrain.core.schema import option

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
    waits_for_checkpoint = True  # rl-cli engine serve --wait-for-model: imports torch and transformers meanwhile
    starts_without_weights = True  # rl-cli engine serve --load-format dummy: the model built from config.json

    @dataclass
    class Config:
        device: str = option("cpu", help="cpu | cuda (placed after the trainer's GPUs) | cuda:N")
        max_running_requests: int = option(32, ge=1, help="KV-cache slots (requests decoded together)")
        decode_attention: Literal["auto", "sdpa", "bmm", "triton"] = option(
            "auto", help="decode attention: auto = triton on a GPU (reads each request's own length), sdpa elsewhere")
        compile: bool = option(False, help="torch.compile the decode step (GPU; slower start)")
        compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = option(
            "default", help="with compile: Inductor's mode; max-autotune-no-cudagraphs times Triton matmul templates "
                            "against cuBLAS per shape (minutes more at start, cached on disk)")
        stable_memory: bool = option(
            True, help="colocated GPU engines: weights and KV cache at fixed virtual addresses (CUDA VMM), so a "
                       "release keeps the CUDA graphs (no recapture each step); off, or where the driver refuses: "
                       "re-allocated")
        overlap: bool = option(
            True, help="GPU: launch decode step N + 1 before step N's tokens reach the host (the host's work on a "
                       "step hides behind the next one); same answers, each one step later")
        fused_sampling: bool = option(
            True, help="GPU: draw uniform batches (all greedy, or one temperature without top-p/top-k/min-p or seeds) "
                       "with a one-pass Triton kernel (an inverse-CDF draw: the same distribution as multinomial, other draws)")
        warm_up: bool = option(
            True, help="GPU: before it answers, the engine generates two tokens with the run's sampling, so the decode "
                       "step's compiles and CUDA graphs are ready for the first rollout (disaggregated: while the trainer "
                       "builds); off: they run in the first rollout")
        prefill_tokens: int = option(0, ge=0, help="prompt tokens per prefill batch (bounds its activation memory); "
                                                   "0: 8192 on the CPU, 32768 on a GPU")
        context_length: int = option(0, ge=0, help="tokens per request; 0: the model's maximum (at most 4096)")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
            "auto", help="weights and KV cache: auto = float32 on the CPU; on a GPU the checkpoint's torch_dtype (a "
                         "float32 policy is sampled in float32), bfloat16 when it names none")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []
        device = self.config.device
        if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            errors.append(f"rollout.engine.device: expected cpu, cuda or cuda:N, got {device!r}")
        arch = getattr(plugins.models.get(run.model.name), "hf_architecture", "") if run.model else ""
        if arch and arch not in SERVED_ARCHITECTURES:
            errors.append(f"rollout.engine: the local engine cannot serve {arch} (model {run.model.name!r}); it "
                          f"serves {', '.join(SERVED_ARCHITECTURES)}. Use rollout.engine.name: sglang")
        return errors

    def on_gpu(self, resources: Any) -> bool:
        return self.config.device.startswith("cuda")

    def engine_gpus(self, resources: Any) -> list[int]:
        device = self.config.device
        if device.startswith("cuda:"):  # every engine on that GPU
            return [int(device[5:])]
        return super().engine_gpus(resources)

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
        return EngineLaunch(local_engine_command(
            slot.model_path, slot.port, host=slot.host, device=device, max_running_requests=cfg.max_running_requests,
            context_length=cfg.context_length or None, cuda_graphs=device == "cuda",
            decode_attention=cfg.decode_attention, compile=cfg.compile, no_overlap=not cfg.overlap,
            compile_mode=None if cfg.compile_mode == "default" else cfg.compile_mode,
            no_fused_sampling=not cfg.fused_sampling, prefill_tokens=cfg.prefill_tokens or None,
            stable_memory=device == "cuda" and cfg.stable_memory and slot.resources.colocate,
            dtype=None if cfg.dtype == "auto" else cfg.dtype, wait_for_model=MODEL_WAIT_S if slot.model_pending else None,
            load_format="dummy" if slot.weights_from_push else None,
            warm_sampling=json.dumps(slot.sampling) if warm else None), env)


def local_engine_command(model_dir: str, port: int, host: str = "127.0.0.1", **options: Any) -> list[str]:
    """The ``rl-cli engine serve`` argv (run through this interpreter) for the local engine."""
    cmd = [sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(model_dir), "--host", host,
           "--port", str(port)]
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
