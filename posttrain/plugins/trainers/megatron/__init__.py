"""The ``megatron`` trainer backend: Megatron-core GPTModel with TP/PP, chunked vocab-parallel log-probs,
Megatron's DDP and (distributed) optimizer on GPUs, dist-checkpointing, bit-exact HF conversion.

Modules (none but the light ``cpu_shims`` is imported here, so this entry module stays light):

- ``spec``: ``DenseGPTSpec``, the Megatron mapping the built-in dense model specs implement; ``moe_spec``:
  ``MoEGPTSpec``, its MoE subclass (router, experts per expert, shared experts, dense first layers);
- ``cpu_shims``: the CPU stand-ins Megatron needs (inactive with CUDA);
- ``model``: parallel init, ``build_gpt``, ``load_hf``, ``iter_hf``, ``save_hf``;
- ``attention``: SDPA / flash-varlen core attention (GPU without TE, CPU, packed sequences);
- ``layers``: GLM-4's post-norm wrappers; ``logprobs``: chunked vocab-parallel log-probs and entropy;
- ``optim``: fused AdamW inside Megatron's optimizer; ``trainer``: ``MegatronTrainer`` (actor or critic);
- ``moe``: routing replay (R3), load-balancing metrics and expert-bias updates of MoE models;
- ``convert``: ``verify_checkpoint`` and HF <-> Megatron directory conversion (``rl-cli models``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl
from posttrain.core.schema import option
from posttrain.core.trainer_backend import TrainerBackend
from posttrain.plugins.trainers.megatron import cpu_shims

cpu_shims.eager_fusers_without_cuda()  # before any module of this package imports megatron.core

OFFLOAD_PARTS = ("weights", "reference", "optimizer", "grads")  # offload.state_parts


class MegatronBackend(TrainerBackend):
    """Megatron-core GPTModel with TP, PP and (MoE) EP, Megatron's DDP and (distributed) optimizer on GPUs.

    On CPU: a torch AdamW with fp32 master weights and our own clipping. The reference policy is a copy of
    the initial weights, on the device when it fits (``ref_offload``), kept only for a run that uses it (a KL term or
    ``trainer.log_kl``). Without Transformer Engine, core attention is SDPA (flash ``varlen_attn``
    for packed samples on GPU)."""

    name = "megatron"
    is_default = True  # a run config without trainer.backend runs this

    @dataclass
    class Config:
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

    offloads = True  # MegatronTrainer.offload/onload (offload.HostOffload)
    # named, with their values, when a pass runs out of GPU memory (core.out_of_memory)
    memory_keys = ("trainer.backend.log_probs_chunk_size", "trainer.backend.log_probs_recompute", "trainer.backend.tp")

    @property
    def needs_routed_experts(self) -> bool:
        return self.config.routing_replay

    def offloaded_bytes_per_parameter(self, run: Any) -> float:
        """The ``offload_parts`` asked, at the model's dtype: weights and reference 2 bytes each (4 at fp32, which has
        no master copy), the optimizer 4 for the fp32 master and 8 for Adam's moments, gradients none (freed). A
        reference kept in host memory anyway (``ref_offload: always``) counts whatever the parts; a run that keeps no
        reference (``run.trainer.uses_reference`` off) counts none."""
        weight = 4 if getattr(run.model.config, "dtype", "bfloat16") == "float32" else 2
        parts = set(self.config.offload_parts) | ({"reference"} if self.config.ref_offload == "always" else set())
        if not run.trainer.uses_reference:
            parts.discard("reference")
        per_part = {"weights": weight, "reference": weight, "optimizer": (0 if weight == 4 else 4) + 8, "grads": 0}
        return float(sum(per_part[part] for part in parts))

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []
        spec = plugins.models.get(run.model.name) if run.model else None
        if spec is not None and not _megatron_mapped(spec):
            mapped = sorted(n for n, s in plugins.models.items() if _megatron_mapped(s))
            errors.append(f"trainer.backend: model {run.model.name!r} has no Megatron mapping; megatron trains "
                          f"{', '.join(mapped)} (trainer.backend.name: fsdp2 trains any HF model)")
        moe = spec is not None and hasattr(spec, "num_experts")
        errors += [f"trainer.backend.{key}: model {run.model.name!r} has no experts" for key, on in
                   (("ep", self.config.ep > 1), ("routing_replay", self.config.routing_replay)) if on and not moe]
        if moe and self.config.tp > 1:  # Megatron's MoE layer trains under TP only with sequence parallelism
            errors.append("trainer.backend.tp: MoE models train with tp=1 here (Megatron's MoE layers need sequence "
                          "parallelism with TP, which this trainer does not run); split the experts with "
                          "trainer.backend.ep")
        c, r = self.config, run.resources
        world, model_parallel = r.trainer_world_size, c.tp * c.pp * c.cp
        if world % model_parallel:
            errors.append(f"trainer.backend: world size {world} (resources.trainer_nodes {r.trainer_nodes} x "
                          f"resources.trainer_procs_per_node {r.procs_per_node}) is not a multiple of "
                          f"trainer.backend.tp x pp x cp = {c.tp} x {c.pp} x {c.cp} = {model_parallel}")
        elif (world // model_parallel) % c.ep:
            errors.append(f"trainer.backend.ep: {c.ep} must divide the {world // model_parallel} data-parallel ranks "
                          f"(Megatron carves expert groups out of them); run {model_parallel * c.ep} ranks or a multiple")
        elif run.trainer.global_batch_size < world // model_parallel:
            errors.append(f"trainer.global_batch_size: {run.trainer.global_batch_size} samples cannot be split "
                          f"over {world // model_parallel} data-parallel ranks")
        if set(c.offload_parts) != set(OFFLOAD_PARTS) and not r.offload_trainer:
            errors.append(f"trainer.backend.offload_parts: {c.offload_parts} is read only with "
                          f"resources.offload_trainer: true")
        if c.pp > 1 and not c.sequence_packing:
            errors.append(f"trainer.backend.pp: pipeline parallelism ({c.pp} stages) needs "
                          f"trainer.backend.sequence_packing: true")
        if c.pp > 1 and c.attention == "local":
            errors.append("trainer.backend.pp: pipeline parallelism needs a packed-sequence attention "
                          "(trainer.backend.attention: auto, sdpa or te), not local")
        if c.cp > 1 and not r.trainer_gpus_per_node:
            errors.append("trainer.backend.cp: context parallelism runs on GPUs only "
                          "(resources.trainer_gpus_per_node is 0)")
        elif c.cp > 1:
            errors.append("trainer.backend.cp: context parallelism needs Transformer Engine's attention and "
                          "CP-split batches, which this trainer does not do yet; use tp and pp")
        return errors

    def build(self, spec: Any, run: Any, role: str = "actor", seed: int = 0) -> Any:
        from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer(spec, run.trainer, backend=self.config, seed=seed, role=role,
                               max_response_len=run.rollout.max_new_tokens)


def _megatron_mapped(spec: Any) -> bool:
    """Whether model spec class ``spec`` maps its family to Megatron (``ModelSpec.has_megatron_mapping``)."""
    mapped = getattr(spec, "has_megatron_mapping", None)
    return mapped() if mapped is not None else hasattr(spec, "transformer_config")


@hookimpl
def posttrain_register_trainers(registry):
    registry.add(MegatronBackend)
