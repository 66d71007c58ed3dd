"""LoRA for the ``megatron`` trainer: adapters on Megatron's tensor-parallel linears, TP-correct, and their export
under HF names (:mod:`posttrain.core.lora` gives the formulas and the push format).

HF target modules map to Megatron's fused linears: ``q_proj``/``k_proj``/``v_proj`` -> ``linear_qkv`` (one adapter for
the fused ``[q; k; v]`` of every query group: naming any of the three adapts all three), ``o_proj`` ->
``linear_proj``, ``gate_proj``/``up_proj`` -> ``linear_fc1`` (``[gate; up]``), ``down_proj`` -> ``linear_fc2``,
``lm_head`` -> ``output_layer``. Routed experts and other attention kinds (MLA) get none.

Each adapted linear holds ``lora_A`` and ``lora_B`` next to its ``weight``, split like it over the TP group (``x``:
the linear's input ``[s, b, in]`` on a column-parallel linear, ``[s, b, in / tp]`` on a row-parallel one)::

    ColumnParallelLinear  W [out/tp, in]:  A [r, in] replicated, B [out/tp, r] split on dim 0
        y_r += s * B_r (copy_to_tp(x A^T))          backward of copy_to_tp: dh summed over TP, so dA is whole
    RowParallelLinear     W [out, in/tp]:  A [r, in/tp] split on dim 1, B [out, r] replicated
        y   += s * (reduce_from_tp(x_r A_r^T)) B^T  forward all-reduce: the partial x A^T summed over TP

(``s = alpha / r``; a forward hook adds the term to the linear's output). The output layer's logits are computed
by the trainer from its weight, so there the adapter enters the weight itself: ``W_r + s B_r copy_to_tp(A)``.
``A`` is drawn from a generator seeded by the run seed and the layer's name (Kaiming-uniform, as peft), the same
full ``A`` on every layout, so TP=2 computes what TP=1 does. Everything else is frozen (``requires_grad`` False):
the optimizer, gradient clipping, reference snapshots and checkpoints then hold the adapters only.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.core.lora import LORA_A, LORA_B

MEGATRON_TARGETS = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
                    "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
                    "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2",
                    "lm_head": "output_layer"}


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def add_adapters(gpt: Any, lora: Any, seed: int) -> dict[str, torch.nn.Module]:
    """Freeze ``gpt`` and give each targeted linear of this rank its adapters; ``{global Megatron name of the
    linear (its weight's name without .weight): module}``. Raises ``ValueError`` when no linear matched."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for p in gpt.parameters():
        p.requires_grad_(False)
    wanted = sorted({MEGATRON_TARGETS[t] for t in lora.target_modules})
    modules: dict[str, torch.nn.Module] = {}
    for layer in gpt.decoder.layers:
        for path in wanted:
            module = _submodule(layer, path)
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                modules[f"decoder.layers.{layer.layer_number - 1}.{path}"] = module
    if "output_layer" in wanted and getattr(gpt, "output_layer", None) is not None:
        modules["output_layer"] = gpt.output_layer
    if not modules and gpt.decoder.layers:
        raise ValueError(f"trainer.lora.target_modules: none of {', '.join(lora.target_modules)} is a dense "
                         f"column/row-parallel linear of this model")
    for name, module in modules.items():
        _attach(module, name, lora, seed, column=isinstance(module, ColumnParallelLinear))
    return modules


def _attach(module: torch.nn.Module, name: str, lora: Any, seed: int, column: bool) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from posttrain.plugins.trainers.megatron.sharding import tp_group_of

    weight = module.weight
    rank, tp, _ = tp_group_of(name + ".weight")
    split = getattr(weight, "tensor_model_parallel", False) and tp > 1
    out_local, in_local = weight.shape
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(lora.rank, in_local if column or not split else in_local * tp)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    if not column and split:
        a = a.chunk(tp, dim=1)[rank]
    b = torch.zeros(out_local, lora.rank)
    module.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(weight.device, weight.dtype))
    if split:  # the split one of the two, along the weight's split dimension
        set_tensor_model_parallel_attributes(module.lora_B if column else module.lora_A, True, 0 if column else 1, 1)
    module.lora_scaling = lora.scaling
    module.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
    module.sharded_state_dict = _sharded_state_dict(module, column)
    if name != "output_layer":  # the trainer computes logits from the weight (output_weight)
        module.register_forward_hook(_column_hook if column else _row_hook)


def _column_hook(module: Any, args: tuple, output: tuple) -> tuple:
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    out, bias = output
    h = copy_to_tensor_model_parallel_region(torch.nn.functional.linear(module.lora_dropout(args[0]), module.lora_A))
    return out + module.lora_scaling * torch.nn.functional.linear(h, module.lora_B), bias


def _row_hook(module: Any, args: tuple, output: tuple) -> tuple:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out, bias = output
    h = reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(module.lora_dropout(args[0]), module.lora_A))
    return out + module.lora_scaling * torch.nn.functional.linear(h, module.lora_B), bias


def _sharded_state_dict(module: Any, column: bool) -> Any:
    """The linear's ``sharded_state_dict`` with its adapters split as they are (Megatron's own map names only
    ``weight`` and ``bias``; another key would be saved as replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        state = module.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=module.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return sharded_state_dict


def output_weight(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """The output layer's weight shard with its adapter, ``W_r + s B_r copy_to_tp(A)`` (the plain weight without)."""
    if getattr(layer, "lora_A", None) is None:
        return weight
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return weight + layer.lora_scaling * (layer.lora_B @ copy_to_tensor_model_parallel_region(layer.lora_A))


def adapter_params(modules: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """``{<linear name>.lora_A: param, ...}`` of this rank (the snapshots' and the optimizer's parameters)."""
    return {f"{name}.{kind}": getattr(m, kind) for name, m in modules.items() for kind in ("lora_A", "lora_B")}


def full_pair(name: str, module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` whole (TP shards gathered like the weight's; a collective over TP)."""
    from posttrain.plugins.trainers.megatron.sharding import gather

    return gather(name + ".weight", module.lora_A), gather(name + ".weight", module.lora_B)


def hf_pairs(spec: Any, hf: dict[str, Any], name: str, a: torch.Tensor, b: torch.Tensor, scaling: float,
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The pushed pairs of one Megatron linear under HF names: ``B`` (scaled) split like the weight's rows by the
    spec (``[q; k; v]`` per query group, ``[gate; up]``, the vocabulary's padding dropped), ``A`` shared by them."""
    for hf_name, part in spec.to_hf(hf, name + ".weight", b * scaling):
        module = hf_name.removesuffix(".weight")
        yield module + LORA_A, a
        yield module + LORA_B, part


def hf_tensors(trainer: Any, view: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of ``trainer`` (a collective over TP, every rank in the same order): ``merged``
    weights ``W + s B @ A`` (in float32, then the weight's dtype), or the ``base`` weights then every adapter pair,
    or the ``adapters`` pairs only (B scaled by s)."""
    from posttrain.plugins.trainers.megatron import model as M

    spec, hf, modules, s = trainer.spec, trainer.hf, trainer.lora_modules, trainer.config.lora.scaling
    if view != "adapters":
        for name, tensor in M._full_tensors(trainer.model, spec, hf):
            linear = name.removesuffix(".weight")
            if view == "merged" and linear in modules:
                a, b = full_pair(linear, modules[linear])
                tensor = (tensor.float() + (b.float() * s) @ a.float()).to(tensor.dtype)
            yield from spec.to_hf(hf, name, tensor)
    if view != "merged":
        for name, module in modules.items():
            yield from hf_pairs(spec, hf, name, *full_pair(name, module), s)


def save_hf(trainer: Any, out_dir: Any) -> Any:
    """The merged HF checkpoint (``model.save_hf``) and, in its ``adapter/``, the adapters in peft's format
    (:func:`posttrain.core.lora.write_peft_adapter`); a collective over TP, rank 0 writes."""
    import torch.distributed as dist
    from pathlib import Path

    from posttrain.core.lora import write_peft_adapter
    from posttrain.plugins.trainers.megatron import model as M

    out = M.save_hf(trainer.model, trainer.spec, trainer.hf, out_dir, source_dir=trainer.spec.config.path,
                    tensors=hf_tensors(trainer, "merged"))
    pairs = {}
    for name, module in trainer.lora_modules.items():
        pairs.update((n, t.to("cpu")) for n, t in hf_pairs(trainer.spec, trainer.hf, name, *full_pair(name, module), 1.0))
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft_adapter(Path(out_dir) / "adapter", pairs, trainer.config.lora, trainer.spec.config.path)
    return out
