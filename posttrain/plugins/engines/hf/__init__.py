"""The ``hf`` engine backend: any ``AutoModelForCausalLM`` behind SGLang's HTTP API, one process per engine.

Slow and universal: HF transformers' own forward pass with its KV cache, a batch at a time (no continuous
batching, no paged cache), for the architectures the ``local`` engine does not serve (gemma3, phi3,
mistral, olmo2, granite, starcoder2, gpt_neox, MoE families, ...). Every weight-sync mode: disk, a
Gloo/NCCL group, tensors (CUDA IPC when colocated). Select it with ``rollout.engine: {name: hf}``.

Modules (none imported here: this entry module stays light): ``generator`` (the model and its decode
loop), ``server`` (the aiohttp app), ``weights`` (the weight-update endpoints).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot
from posttrain.core.schema import option


class HFEngine(EngineBackend):
    """HF ``transformers`` forward passes behind SGLang's protocol, for any causal LM checkpoint.

    On ``device: cuda`` engine ``i`` takes the GPU the run's placement gives it (after the trainer's unless
    colocated); ``cuda:N`` puts every engine on GPU N. A list request with one seeded ``sampling_params``
    seeds row ``j`` with ``seed + j``, drawn as the local engine draws (a function of seed and step).
    """

    name = "hf"
    seeds_batch_rows = True
    flat_weight_buckets = True
    merges_adapters = True  # LoRA pushes: adapter pairs merged from each weight's kept base
    starts_without_weights = True  # --load-format dummy: built from config.json, every weight from the first push

    @dataclass
    class Config:
        device: str = option("cpu", help="cpu | cuda (placed after the trainer's GPUs) | cuda:N")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
            "auto", help="weights: auto = float32 on the CPU, the checkpoint's torch_dtype on a GPU")
        max_batch_size: int = option(256, ge=1, help="rows decoded together (requests waiting join the next batch)")
        context_length: int = option(0, ge=0, help="tokens per request; 0: the model's max_position_embeddings")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        device = self.config.device
        if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            return [f"rollout.engine.device: expected cpu, cuda or cuda:N, got {device!r}"]
        return []

    def on_gpu(self, resources: Any) -> bool:
        return self.config.device.startswith("cuda")

    def engine_gpus(self, resources: Any) -> list[int]:
        if self.config.device.startswith("cuda:"):
            return [int(self.config.device[5:])]
        return super().engine_gpus(resources)

    def launch(self, slot: EngineSlot) -> EngineLaunch:
        from posttrain.core.rollout.backend import API_KEY_ENV, gpu_ids
        from posttrain.core.rollout.fleet import visible_device

        device, env = self.config.device, {API_KEY_ENV: slot.api_key, "OMP_NUM_THREADS": "1"}
        if device == "cuda":
            device = f"cuda:{gpu_ids(slot.resources, slot.index)[0]}"
        if device.startswith("cuda:"):  # the server sees its GPU alone, as cuda:0
            env["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":")[1]))
            device = "cuda"
        c = self.config
        cmd = [sys.executable, "-m", "posttrain.plugins.engines.hf.server", slot.model_path, "--host", slot.host,
               "--port", str(slot.port), "--device", device, "--dtype", c.dtype, "--max-batch-size",
               str(c.max_batch_size), "--context-length", str(c.context_length), "--seed", str(slot.seed + slot.index)]
        if slot.weights_from_push:
            cmd += ["--load-format", "dummy"]
        return EngineLaunch(cmd, env)


@hookimpl
def posttrain_register_engines(registry):
    registry.add(HFEngine)
