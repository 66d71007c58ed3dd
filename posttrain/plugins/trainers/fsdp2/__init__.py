"""The ``fsdp2`` trainer backend: any HF ``AutoModelForCausalLM``, sharded over the trainer group's ranks with
torch FSDP2 (``fully_shard``), mixed precision, activation checkpointing and CPU offload as configured.

Modules (none imported here: this entry module stays light):

- ``model``: ``FSDP2Model`` (build, shard, log-probs, the train step, the reference, HF export);
- ``parallel``: the process group, each rank's share, micro-batch counts agreed by every rank;
- ``packing``: sequence packing (a micro-batch's samples in one row, attention kept within each sample);
- ``checkpoint``: resume through torch.distributed.checkpoint (any data-parallel size), ``save_hf``;
- ``vision``: vision-language models (``AutoModelForImageTextToText``): the tower, freezing it, pixel inputs.

Select it with ``trainer: {backend: {name: fsdp2}}``; the algorithm's keys (lr, batch sizes, KL, entropy,
clipping, Adam) stay in ``trainer``. It builds the spec's HF architecture from its ``config.json``
mapping, so it trains every model spec, the generic ``hf`` one included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttrain import hookimpl
from posttrain.core.schema import option
from posttrain.core.trainer_backend import TrainerBackend


class FSDP2Backend(TrainerBackend):
    """Torch FSDP2 over HF transformers: float32 master weights sharded over every rank, compute in
    ``param_dtype``, gradients reduced in ``reduce_dtype``, torch AdamW on the shards. Actor only (no
    critic); no offload between phases (``resources.offload_trainer``)."""

    name = "fsdp2"
    memory_keys = ("trainer.backend.activation_checkpointing", "trainer.backend.cpu_offload")

    @dataclass
    class Config:
        param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
            "auto", help="forward/backward compute dtype; auto = model.dtype (the master weights stay float32)")
        reduce_dtype: Literal["float32", "bfloat16"] = option("float32", help="dtype of the gradient reduce-scatter")
        activation_checkpointing: bool = option(False, help="recompute each decoder layer's activations in backward")
        scaled_output_init: bool = option(
            True, help="random init (no model.path): each block's residual-output projections (o_proj, down_proj, ...) "
                       "drawn with std / sqrt(2 x layers), as Megatron draws them; false: transformers' own init")
        cpu_offload: bool = option(False, help="GPU: parameters, gradients and optimizer state in host memory "
                                               "(FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU)")
        freeze_vision: bool = option(True, help="vision-language models: the vision tower does not train (AdamW "
                                                "holds the language model's parameters only)")
        sequence_packing: bool | Literal["auto"] = option(
            "auto", help="pack a micro-batch's samples into one row (positions restart per sample, attention stays "
                         "within each: no padding computed; max_tokens_per_micro_batch then counts real tokens); "
                         "auto = wherever the architecture can (text models whose attention takes transformers' "
                         "varlen kwargs), else padded rows with a one-line note")

    def check_config(self, run: Any, plugins: Any) -> list[str]:
        errors = []
        from posttrain.core.interfaces import needs_of

        estimator = plugins.estimators.get(run.estimator.name) if getattr(run, "estimator", None) else None
        if estimator is not None and needs_of(estimator).critic:
            errors.append(f"trainer.backend: fsdp2 trains no critic, which estimator {run.estimator.name!r} needs; "
                          f"use trainer.backend.name: megatron")
        if self.config.cpu_offload and not run.resources.trainer_gpus_per_node:
            errors.append("trainer.backend.cpu_offload: offloads GPU memory; this trainer runs on the CPU "
                          "(resources.trainer_gpus_per_node is 0)")
        from posttrain.core.lora import tied_head_error

        spec = run.model.create(plugins) if run.model is not None else None
        errors += tied_head_error(run.trainer.lora, spec)
        if spec is not None and self.config.sequence_packing is not False:
            from posttrain.core.errors import UsageError
            from posttrain.plugins.trainers.fsdp2.packing import resolve

            try:  # auto on a model that cannot pack says so in one line and pads
                resolve(self.config.sequence_packing, spec.hf_config())
            except UsageError as exc:
                errors.append(str(exc))
        if run.trainer.global_batch_size < run.resources.trainer_world_size:
            errors.append(f"trainer.global_batch_size: {run.trainer.global_batch_size} samples cannot be split over "
                          f"{run.resources.trainer_world_size} data-parallel ranks")
        return errors

    def build(self, spec: Any, run: Any, role: str = "actor", seed: int = 0) -> Any:
        from posttrain.plugins.trainers.fsdp2.model import FSDP2Model

        return FSDP2Model(spec, run.trainer, backend=self.config, seed=seed, role=role,
                          max_response_len=run.rollout.max_new_tokens)


@hookimpl
def posttrain_register_trainers(registry):
    registry.add(FSDP2Backend)
