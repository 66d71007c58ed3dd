"""The ``megatron`` trainer backend: Megatron-core GPTModel with TP/PP, chunked vocab-parallel log-probs,
Megatron's DDP and (distributed) optimizer on GPUs, dist-checkpointing, bit-exact HF conversion.

Modules (none but the light ``cpu_shims`` is imported here, so this entry module stays light):

- ``spec``: ``DenseGPTSpec``, the Megatron mapping the built-in dense model specs implement; ``moe_spec``:
  ``MoEGPTSpec``, its MoE subclass (router, experts per expert, shared experts, dense first layers);
- ``cpu_shims``: the CPU stand-ins Megatron needs (inactive with CUDA);
- ``options``: ``MegatronConfig``, the backend's ``trainer.backend`` options;
- ``model``: parallel init, ``build_gpt``, ``load_hf``, ``iter_hf``, ``save_hf``; ``sharding``: TP shards of
  full tensors and back; ``init``: seeded initialization of a rank's shards;
- ``attention``: SDPA / flash-varlen core attention (GPU without TE, CPU, packed sequences);
- ``layers``: GLM-4's post-norm wrappers; ``logprobs``: chunked vocab-parallel log-probs and entropy;
- ``optim``: fused AdamW inside Megatron's optimizer; ``trainer``: ``MegatronTrainer`` (actor or critic);
- ``moe``: routing replay (R3), load-balancing metrics and expert-bias updates of MoE models;
- ``convert``: ``verify_checkpoint`` and HF <-> Megatron directory conversion (``rl-cli models verify`` and
  ``convert`` reach them through the backend's ``verify_hf`` / ``checkpoint_from_hf`` / ``checkpoint_to_hf``).
"""

from __future__ import annotations

from typing import Any

from posttrain import hookimpl
from posttrain.core.trainer_backend import TrainerBackend
from posttrain.plugins.trainers.megatron import cpu_shims
from posttrain.plugins.trainers.megatron.options import OFFLOAD_PARTS, MegatronConfig

cpu_shims.eager_fusers_without_cuda()  # before any module of this package imports megatron.core

class MegatronBackend(TrainerBackend):
    """Megatron-core GPTModel with TP, PP and (MoE) EP, Megatron's DDP and (distributed) optimizer on GPUs.

    On CPU: a torch AdamW with fp32 master weights and our own clipping. The reference policy is a copy of
    the initial weights, on the device when it fits (``ref_offload``), kept only for a run that uses it (a KL term or
    ``trainer.log_kl``). Without Transformer Engine, core attention is SDPA (flash ``varlen_attn``
    for packed samples on GPU)."""

    name = "megatron"
    is_default = True  # a run config without trainer.backend runs this

    Config = MegatronConfig

    offloads = True  # MegatronTrainer.offload/onload (offload.HostOffload)
    exact_mode = True  # rollout.exact: core.exact's norms, SwiGLU, attention and matmuls (exact_attention.py)
    # named, with their values, when a pass runs out of GPU memory (core.out_of_memory)
    memory_keys = ("trainer.backend.log_probs_chunk_size", "trainer.backend.log_probs_recompute", "trainer.backend.tp")

    def logits_chunk_tokens(self) -> int | None:
        return self.config.log_probs_chunk_size

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
        if getattr(getattr(run, "data", None), "images_key", None):
            errors.append("trainer.backend: megatron trains text models only; images (data.images_key) need "
                          "trainer.backend.name: fsdp2")
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
        if run.rollout.exact:
            errors += [f"rollout.exact: needs trainer.backend.{key} ({why})" for key, why, bad in (
                ("tp: 1", "tensor parallelism splits sums over ranks in another order than the engine's", c.tp > 1),
                ("ep: 1", "expert parallelism sums a token's experts on other ranks, in another order than the "
                          "engine's", c.ep > 1),
                ("compile: false", "compiled layers fuse norms and SwiGLU their own way", c.compile)) if bad]
        if c.cp > 1 and not r.trainer_gpus_per_node:
            errors.append("trainer.backend.cp: context parallelism runs on GPUs only "
                          "(resources.trainer_gpus_per_node is 0)")
        elif c.cp > 1:
            errors.append("trainer.backend.cp: context parallelism needs Transformer Engine's attention and "
                          "CP-split batches, which this trainer does not do yet; use tp and pp")
        return errors + _lora_errors(run, c, plugins)

    def build(self, spec: Any, run: Any, role: str = "actor", seed: int = 0) -> Any:
        from posttrain.plugins.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer(spec, run.trainer, backend=self.config, seed=seed, role=role,
                               max_response_len=run.rollout.max_new_tokens, exact=run.rollout.exact)


    def verify_hf(self, spec: Any, hf_dir: str, *, tp: int = 1, ep: int = 1, pp: int = 1, tolerance: float = 1e-4,
                  seq_len: int = 16, attention: str = "auto") -> dict[str, Any] | None:
        from posttrain.plugins.trainers.megatron.convert import verify_checkpoint
        from posttrain.plugins.trainers.megatron.model import init_parallel

        init_parallel(tp, pp, ep=ep)
        result = verify_checkpoint(spec, hf_dir, tolerance=tolerance, seq_len=seq_len, attention=attention)
        return result if _rank() == 0 else None

    def checkpoint_from_hf(self, spec: Any, hf_dir: str, out: str, *, tp: int = 1) -> bool:
        """A Megatron dist-checkpoint (torch_dist) of ``tp`` shards."""
        from posttrain.plugins.trainers.megatron.convert import hf_to_megatron_dir
        from posttrain.plugins.trainers.megatron.model import init_parallel

        init_parallel(tp, 1)
        hf_to_megatron_dir(spec, hf_dir, out)
        return _rank() == 0

    def checkpoint_meta(self, src: str) -> dict[str, Any]:
        from posttrain.plugins.trainers.megatron.convert import read_meta

        return read_meta(src)

    def checkpoint_to_hf(self, spec: Any, src: str, out: str, hf_config: dict[str, Any], *, tp: int = 1) -> bool:
        from posttrain.plugins.trainers.megatron.convert import megatron_dir_to_hf
        from posttrain.plugins.trainers.megatron.model import init_parallel

        init_parallel(tp, 1)
        megatron_dir_to_hf(spec, src, out, hf_config)
        return _rank() == 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _megatron_mapped(spec: Any) -> bool:
    """Whether model spec class ``spec`` maps its family to Megatron (``ModelSpec.has_megatron_mapping``)."""
    mapped = getattr(spec, "has_megatron_mapping", None)
    return mapped() if mapped is not None else hasattr(spec, "transformer_config")


@hookimpl
def posttrain_register_trainers(registry):
    registry.add(MegatronBackend)


def _lora_errors(run: Any, c: Any, plugins: Any) -> list[str]:
    """``trainer.lora`` with this backend: adapters on one pipeline stage set and without sequence parallelism."""
    from posttrain.core.lora import tied_head_error

    lora = run.trainer.lora
    if not lora.enabled:
        return []
    errors = tied_head_error(lora, run.model.create(plugins) if run.model is not None else None)
    if c.pp > 1:
        errors.append(f"trainer.lora: LoRA on the megatron backend runs with pp=1 (have trainer.backend.pp {c.pp})")
    if c.megatron.get("sequence_parallel"):
        errors.append("trainer.lora: LoRA on the megatron backend runs without trainer.backend.megatron."
                      "sequence_parallel")
    return errors
