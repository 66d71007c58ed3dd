"""The ``hf_generate`` engine backend: one :mod:`posttrain_thirdparty.hf_server` process per engine.

Select it with ``rollout.engine: {name: hf_generate}``. Its servers reload weights from an HF checkpoint
the trainer writes (``rollout.weight_sync: disk``, what ``auto`` resolves to for it); they join no
weight-update group.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl, option
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot


class HFGenerateEngine(EngineBackend):
    """Plain HF ``transformers`` forward passes behind SGLang's HTTP API (batch at a time, no paged KV cache).

    Any ``AutoModelForCausalLM`` checkpoint; weights update from disk only. A batched request with one
    seeded ``sampling_params`` seeds row ``j`` with ``seed + j``.
    """

    name = "hf_generate"
    weight_sync_modes = ("disk",)
    seeds_batch_rows = True

    @dataclass
    class Config:
        device: str = option("cpu", help="cpu | cuda (GPU index from the run's placement) | cuda:N")
        max_batch_size: int = option(256, ge=1, help="rows decoded together")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []  # an explicit rollout.weight_sync other than disk is reported by posttrain (weight_sync_modes)
        device = self.config.device
        if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
            errors.append(f"rollout.engine.device: expected cpu, cuda or cuda:N, got {device!r}")
        return errors

    def on_gpu(self, resources: Any) -> bool:
        return self.config.device.startswith("cuda")

    def launch(self, slot: EngineSlot) -> EngineLaunch:
        device, env = self.config.device, {}
        if device == "cuda" and slot.gpus:
            device = f"cuda:{slot.gpus[0]}"
        if device.startswith("cuda:"):  # the server sees its GPU alone
            from posttrain.core.rollout.fleet import visible_device

            env["CUDA_VISIBLE_DEVICES"] = visible_device(int(device.split(":")[1]))
            device = "cuda"
        return EngineLaunch([sys.executable, "-m", "posttrain_thirdparty.hf_server", slot.model_path,
                             "--host", slot.host, "--port", str(slot.port), "--device", device,
                             "--max-batch-size", str(self.config.max_batch_size), "--seed", str(slot.seed + slot.index)],
                            env={"OMP_NUM_THREADS": "1", **env})


@hookimpl
def posttrain_register_engines(registry):
    registry.add(HFGenerateEngine)
