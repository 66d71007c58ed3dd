"""The ``torch_simple`` trainer backend: an HF ``AutoModelForCausalLM`` trained with torch AdamW, no Megatron.

Select it with ``trainer: {backend: {name: torch_simple}}``; the algorithm keys (lr, schedule, batch
sizes, KL, entropy, clipping, Adam) stay in ``trainer``. The model is in
:mod:`posttrain_thirdparty.torch_model` (imported on ``build``: this entry module stays light).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl, option
from posttrain.core.trainer_backend import TrainerBackend


class TorchSimpleTrainer(TrainerBackend):
    """Plain PyTorch: the HF model of the spec's ``config.json`` (or its checkpoint), one device, AdamW.

    Weights and optimizer state are float32 whatever ``model.dtype`` says (an lr-1e-6 step vanishes in
    bf16); ``export_hf`` and ``save_hf`` cast to ``model.dtype``. Log-probs take the full ``[B, T, V]``
    logits of a micro-batch (no chunking): for small models.
    """

    name = "torch_simple"

    @dataclass
    class Config:
        device: str = option("auto", help="auto (cuda when available, else cpu) | cpu | cuda | cuda:N")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        device = self.config.device
        if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
            return [f"trainer.backend.device: expected auto, cpu, cuda or cuda:N, got {device!r}"]
        return []

    def on_gpu(self) -> bool:
        if self.config.device == "auto":
            import torch

            return torch.cuda.is_available()
        return self.config.device.startswith("cuda")

    def build(self, spec: Any, run: Any, role: str = "actor", seed: int = 0) -> Any:
        from posttrain_thirdparty.torch_model import TorchModel

        return TorchModel(spec, run.trainer, device=self.config.device, seed=seed, role=role,
                          max_response_len=run.rollout.max_new_tokens)


@hookimpl
def posttrain_register_trainers(registry):
    registry.add(TorchSimpleTrainer)
