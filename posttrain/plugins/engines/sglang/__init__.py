"""The ``sglang`` engine backend: real SGLang servers (``python -m sglang.launch_server``), one per engine,
``resources.gpus_per_engine`` GPUs each (its TP size), after the trainer's GPUs unless colocated.

SGLang is not a dependency (``pip install posttrain[sglang]`` on GPU machines); the launcher only builds
command lines, so this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl
from posttrain.core.rollout.backend import EngineBackend, EngineLaunch, EngineSlot
from posttrain.core.schema import option


class SGLangEngine(EngineBackend):
    """Real SGLang servers (``sglang.launch_server``), the production path on GPUs.

    Every SGLang server option passes through ``args`` (``{attention_backend: fa3}`` becomes
    ``--attention-backend fa3``); posttrain sets the model path, host, port, TP size, seed, base GPU and
    (colocated) ``--enable-memory-saver`` itself.

    Seeded sampling needs ``args: {enable_deterministic_inference: true}``; seeded groups are then sent one
    request per sample (SGLang seeds a whole batched request alike). Routing replay (MoE) needs
    ``args: {enable_return_routed_experts: true}``: SGLang answers ``return_routed_experts`` only then.

    The servers start with ``--load-format dummy`` (random weights, none read) and take every weight from the
    run's first push, unless ``args`` sets ``load_format`` (the run then writes the initial weights for them).
    """

    name = "sglang"

    @dataclass
    class Config:
        mem_fraction_static: float | None = option(None, gt=0.0, lt=1.0, help="SGLang --mem-fraction-static")
        args: dict[str, Any] = option(default_factory=dict, help="extra SGLang server options by name")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        from posttrain.plugins.engines.sglang.launcher import RESERVED

        errors = [f"rollout.engine.args.{key}: set from the run config; remove it here" for key in self.config.args
                  if key.replace("-", "_") in RESERVED]
        backend = getattr(getattr(run, "trainer", None), "backend", None)
        replay = backend is not None and getattr(backend.create(plugins), "needs_routed_experts", False)
        if replay and not self.config.args.get("enable_return_routed_experts"):  # SGLang answers only then
            errors.append("rollout.engine.args.enable_return_routed_experts: must be true when the trainer replays "
                          "MoE routing (trainer.backend.routing_replay)")
        return errors

    @property
    def starts_without_weights(self) -> bool:  # unless the user chose how SGLang loads
        return "load_format" not in {key.replace("-", "_") for key in self.config.args}

    def on_gpu(self, resources: Any) -> bool:
        return True

    def ranks_per_engine(self, resources: Any) -> int:
        return resources.gpus_per_engine

    def check_weights(self, url: str, api_key: str | None, buckets: Any, every: int = 8,
                      rows: int = 100) -> str | None:
        """SGLang has no per-tensor checksum: every ``every``-th tensor (the first included) is read back
        with ``POST /get_weights_by_name {name, truncate_size}`` (its first ``rows`` rows, as float32
        lists, TP shards gathered by SGLang) and compared exactly with the pushed tensor's rows."""
        from posttrain.core.rollout.weight_sync import post_json

        index = 0
        for bucket in buckets:
            for name, tensor in bucket:
                index += 1
                if (index - 1) % every:
                    continue
                got = post_json(url + "/get_weights_by_name", {"name": name, "truncate_size": rows}, api_key=api_key)
                want = tensor.detach().float().cpu()[:rows].tolist()
                if got != want:
                    return f"tensor {name}: its first {rows} rows differ from what was pushed"
        return None

    def launch(self, slot: EngineSlot) -> EngineLaunch:
        from posttrain.core.rollout.backend import API_KEY_ENV
        from posttrain.plugins.engines.sglang.launcher import sglang_command, sglang_spec_from_config

        spec = sglang_spec_from_config(self.config, slot.resources, slot.model_path, slot.port,
                                       engine_index=slot.index, seed=slot.seed)
        spec.host = slot.host
        if slot.weights_from_push:
            spec.extra["load_format"] = "dummy"
        cmd = sglang_command(spec)
        if slot.api_key:  # the key goes by environment; the wrapper hands it to SGLang as --api-key
            cmd[cmd.index("sglang.launch_server")] = "posttrain.plugins.engines.sglang.serve"
        return EngineLaunch(cmd, {API_KEY_ENV: slot.api_key} if slot.api_key else {})


@hookimpl
def posttrain_register_engines(registry):
    registry.add(SGLangEngine)
