"""The ``megatron`` trainer backend's options (``trainer.backend``), apart from the backend so that the
trainer and the tests build them without the entry module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttrain.core.schema import option

OFFLOAD_PARTS = ("weights", "reference", "optimizer", "grads")  # offload.state_parts


@dataclass
class MegatronConfig:
    """``trainer.backend`` of the megatron backend: parallelism, attention, log-prob chunks, offload, optimizer
    kernels and Megatron pass-through fields."""

    tp: int = option(1, ge=1, help="tensor-parallel size")
    pp: int = option(1, ge=1, help="pipeline-parallel size (needs sequence_packing; actor only)")
    cp: int = option(1, ge=1, help="context-parallel size (GPUs with Transformer Engine only)")
    ep: int = option(1, ge=1, help="expert-parallel size (MoE models): experts split over ep of the data-parallel "
                                   "ranks")
    routing_replay: bool = option(False, help="MoE: the trainer's routers use the experts the engine chose (R3; "
                                              "the engines are asked for return_routed_experts)")
    attention: Literal["auto", "sdpa", "local", "te"] = option(
        "auto", help="core attention: auto = TE if installed on GPU, else SDPA")
    compile: bool = option(False, help="torch.compile each transformer layer (fuses norms, SwiGLU, rotary)")
    sequence_packing: bool = option(True, help="pack a micro-batch's samples into one row (THD attention)")
    dedup_inputs: bool = option(True, help="padded rows: samples with the same inputs run the layers once "
                                "(GRPO's one-token answers; dense models without dropout; trainers/megatron/dedup.py)")
    log_probs_chunk_size: int = option(1024, ge=1, help="tokens per chunk of the vocab-parallel log-softmax")
    log_probs_recompute: bool = option(True, help="backward recomputes each chunk's logits (least memory); "
                                                  "false keeps them (tokens x vocab/tp in bf16) and skips that matmul")
    ref_offload: Literal["auto", "never", "always"] = option(
        "auto", help="where the reference weights live: never = on the device (no copy per reference pass), "
                     "always = pinned host memory copied in per pass, auto = on the device when they take "
                     "at most 10% of its memory")
    offload_parts: list[Literal["weights", "reference", "optimizer", "grads"]] = option(
        default_factory=lambda: list(OFFLOAD_PARTS),
        help="what resources.offload_trainer moves off the GPU while the engines generate: weights (the model's "
             "parameters), reference (the reference weights kept on the GPU), optimizer (fp32 master weights and "
             "Adam's moments), grads (gradient buffers: freed, not copied). What stays costs no copy; "
             "[optimizer, grads] is verl's optimizer_offload + grad_offload")
    offload_overlap: bool = option(
        True, help="offloaded (GPU): the optimizer's state moves on a side stream, back behind the log-prob and "
                   "forward/backward passes (awaited only by the optimizer step and a checkpoint) and out with the "
                   "weight push; false moves it with the rest")
    use_distributed_optimizer: bool = option(True, help="Megatron's distributed optimizer (GPU only; CPU uses "
                                                        "torch AdamW)")
    fused_adam: bool = option(True, help="GPU without TE/Apex: torch's fused AdamW inside Megatron's optimizer")
    megatron: dict[str, Any] = option(default_factory=dict,
                                      help="Megatron TransformerConfig/DDP/optimizer fields by name")

    def validate(self) -> list[str]:
        if not self.offload_parts:
            return ["offload_parts: empty (name at least one of " + ", ".join(OFFLOAD_PARTS) + ", or set "
                    "resources.offload_trainer: false)"]
        if not self.megatron:
            return []
        from posttrain.core.errors import UsageError
        from posttrain.plugins.trainers.megatron.model import split_megatron_overrides

        try:  # checked against Megatron's own dataclasses: a misspelled field is an error
            split_megatron_overrides(self.megatron)
        except UsageError as exc:
            return [str(exc).removeprefix("trainer.backend.")]
        return []
