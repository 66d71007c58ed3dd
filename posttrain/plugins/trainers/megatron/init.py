"""Random initial weights that depend on the seed alone: not on the device, TP or PP.

Megatron initializes each rank's shards where they live: on a GPU from the CUDA RNG tracker (a stream
per TP rank), on the CPU from master tensors drawn one after another from the global generator. So the
same seed gave a CPU run and a GPU run different models, and a run could not be compared step for step
across devices or layouts.

:func:`seeded_init` draws every parameter's *full* (TP=1) tensor on the CPU, in the order Megatron's CPU
initialization draws them for the whole TP=1, PP=1 model (its construction order), from a generator
seeded with ``seed``; then it keeps this rank's shard (:func:`~posttrain.plugins.trainers.megatron.model.shard`, the
same split as loading an HF checkpoint) and copies it to the parameter's device and dtype. Every rank
draws the whole stream, also the tensors other stages and other EP ranks hold, so a stage's shards and a
rank's experts do not depend on PP or EP.
At TP=1 on the CPU the result is bit-identical to Megatron's own CPU initialization (tested), so CPU
runs keep the weights they had.

Which init function a tensor gets follows Megatron's layers: embeddings ``embedding_init_method``,
column-parallel weights and MoE router weights ``init_method``, row-parallel weights (attention, MLP and
expert output projections) ``output_layer_init_method``, biases zero; norm weights keep what their
constructors set (no draws). (A router weight left out stays ``torch.empty``: garbage, NaN or zeros.)
"""

from __future__ import annotations

import re
from typing import Any

import torch

from posttrain.core.errors import UsageError
from posttrain.plugins.trainers.megatron.sharding import ep_info, mark_tp_params, shard, tp_info

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _inner(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _kind(module: Any, attr: str) -> str | None:
    """``"embedding" | "column" | "row" | "zero"`` for a Megatron parallel layer's parameter, or None.
    A MoE router's ``[E, H]`` weight is a plain parameter, drawn like a column-parallel weight
    (Megatron's ``Router.reset_parameters``: ``init_method``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe.router import Router

    if attr == "bias" and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return "zero"
    if attr != "weight":
        return None
    if isinstance(module, Router):
        return "column"
    if isinstance(module, VocabParallelEmbedding):
        return "embedding"
    if isinstance(module, RowParallelLinear):  # checked first: keep the two linear kinds apart
        return "row"
    if isinstance(module, ColumnParallelLinear):
        return "column"
    return None


def _entries(module: Any, prefix: str) -> list[tuple[str, str | None, Any]]:
    """``(name, kind, param)`` for ``module``'s parameters in registration (= construction) order."""
    out = []
    for name, param in module.named_parameters():
        owner, _, attr = name.rpartition(".")
        out.append((f"{prefix}.{name}" if prefix else name, _kind(module.get_submodule(owner), attr), param))
    return out


def _full_shape(param: Any, tp: int) -> list[int]:
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def _layer_kinds(spec: Any, hf: dict[str, Any]) -> list[str]:
    """``"moe" | "dense"`` per decoder layer (a spec without ``moe_layers`` has dense layers only): a
    layer of another stage is drawn with the shapes of a local layer of its kind."""
    moe = spec.moe_layers(hf) if hasattr(spec, "moe_layers") else [False] * int(hf["num_hidden_layers"])
    return ["moe" if m else "dense" for m in moe]


def _every_expert(template: list[tuple[str, list[int], str | None]], experts: int) -> list[tuple[str, list[int], str | None]]:
    """A layer's ``(name, shape, kind)`` with its local experts' entries replaced by all ``experts``
    experts' (global numbers, expert 0's shapes), in Megatron's construction order at EP=1, so a rank
    draws every expert and keeps its own: the weights do not depend on EP."""
    per_expert = [(m.group(2), shape, kind) for n, shape, kind in template
                  if (m := _EXPERT.match(n)) and m.group(1) == "0"]
    out: list[tuple[str, list[int], str | None]] = []
    placed = False
    for n, shape, kind in template:
        if not _EXPERT.match(n):
            out.append((n, shape, kind))
        elif not placed:  # where the local experts start: every expert, in order
            out += [(f"mlp.experts.local_experts.{e}.{rest}", sh, kd) for e in range(experts)
                    for rest, sh, kd in per_expert]
            placed = True
    return out


def _local_expert(name: str, first: int, held: int) -> str | None:
    """The local parameter name of global expert parameter ``name`` (itself if not an expert's), None if
    another EP rank holds it."""
    m = _EXPERT.match(name)
    if not m:
        return name
    e = int(m.group(1)) - first
    return f"mlp.experts.local_experts.{e}.{m.group(2)}" if 0 <= e < held else None


def _meta_layer(gpt: Any, spec: Any, hf: dict[str, Any], layer: int) -> Any:
    """Decoder layer ``layer`` (held by another pipeline stage) built on the meta device, TP attributes
    marked, for its parameters' shapes; the spec must say how (``layer_module_spec``)."""
    from megatron.core.transformer.spec_utils import build_module

    if not hasattr(spec, "layer_module_spec"):
        raise UsageError(f"seeded initialization: layer {layer} differs from this pipeline stage's layers and "
                         f"spec {spec.name!r} has no layer_module_spec to build it from; load a checkpoint instead")
    with torch.device("meta"):
        module = build_module(spec.layer_module_spec(hf, layer), config=gpt.config, layer_number=layer + 1)
    mark_tp_params(module)
    return module


def _plan(gpt: Any, spec: Any, hf: dict[str, Any], tp: int) -> list[tuple[str, list[int], str | None, Any]]:
    """``(global name, full shape, kind, local param or None)`` for the whole TP=1, PP=1 model, in the
    order Megatron constructs it: embedding, layers 0..L-1 (each its own shapes: dense and MoE layers
    differ), output layer."""
    vocab_rows = spec.padded_vocab_size(hf, 1)
    hidden = int(hf["hidden_size"])
    # the embedding draws first, also on stages that do not hold it (rope: no position embeddings)
    word = getattr(getattr(getattr(gpt, "embedding", None), "word_embeddings", None), "weight", None)
    plan: list[tuple[str, list[int], str | None, Any]] = [
        ("embedding.word_embeddings.weight", [vocab_rows, hidden], "embedding", word)]
    layers = list(gpt.decoder.layers)
    local = {layer.layer_number - 1: layer for layer in layers}

    def shapes(layer):
        return [(name, _full_shape(p, tp), kind) for name, kind, p in _entries(layer, "")]

    experts = int(getattr(gpt.config, "num_moe_experts", 0) or 0)
    ep_rank, ep = ep_info() if experts else (0, 1)
    held = experts // ep  # this EP rank's experts: first .. first + held - 1
    first = ep_rank * held
    kinds = _layer_kinds(spec, hf)
    templates = {kinds[i]: shapes(layer) for i, layer in local.items()}  # other stages' layers: like ours
    for i in range(int(hf["num_hidden_layers"])):
        if kinds[i] not in templates:  # no layer of its kind on this stage: build one on the meta device
            templates[kinds[i]] = shapes(_meta_layer(gpt, spec, hf, i))
        params = {n: p for n, _, p in _entries(local[i], "")} if i in local else {}
        template = _every_expert(shapes(local[i]) if i in local else templates[kinds[i]], experts)
        plan += [(f"decoder.layers.{i}.{n}", shape, kind, params.get(_local_expert(n, first, held)))
                 for n, shape, kind in template]
    # the final norm draws nothing; an untied output layer draws last (a tied one is the embedding)
    if not spec.tied(hf):
        weight = getattr(getattr(gpt, "output_layer", None), "weight", None)
        plan.append(("output_layer.weight", [vocab_rows, hidden], "column", weight))
    return plan


@torch.no_grad()
def seeded_init(model: Any, spec: Any, hf: dict[str, Any], seed: int) -> None:
    """Fill this rank's parameters of ``model`` (built with ``perform_initialization=False``) from ``seed``."""
    gpt = _inner(model)
    rank, tp = tp_info()
    cfg = gpt.config
    init = {"embedding": getattr(cfg, "embedding_init_method", None) or cfg.init_method,
            "column": cfg.init_method, "row": cfg.output_layer_init_method}
    drawn: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):  # the global CPU generator, as Megatron's CPU init uses it
        torch.manual_seed(seed)
        for name, shape, kind, param in _plan(gpt, spec, hf, tp):
            if kind is None or kind == "zero":
                if param is not None and kind == "zero":
                    param.zero_()
                continue  # norm weights: set by their constructors, no draw
            full = torch.empty(shape, dtype=torch.float32)
            init[kind](full)
            if name == "embedding.word_embeddings.weight":
                drawn[name] = full
            if param is not None:
                _copy_shard(name, param, full, rank, tp, shard)
    weight = getattr(getattr(gpt, "output_layer", None), "weight", None)
    if spec.tied(hf) and weight is not None and getattr(gpt, "embedding", None) is None:
        # the last PP stage's copy of a tied embedding (first and last stage keep them equal)
        _copy_shard("output_layer.weight", weight, drawn["embedding.word_embeddings.weight"], rank, tp, shard)


def _copy_shard(name: str, param: Any, full: torch.Tensor, rank: int, tp: int, shard: Any) -> None:
    rows = param.shape[0] * tp if getattr(param, "tensor_model_parallel", False) and param.partition_dim == 0 else None
    if name.endswith(("word_embeddings.weight", "output_layer.weight")) and rows and rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])  # TP-dependent padding
    piece = shard(name, param, full, rank, tp)
    if tuple(piece.shape) != tuple(param.shape):
        raise UsageError(f"seeded init: {name}: shard {tuple(piece.shape)} does not fit {tuple(param.shape)}")
    param.copy_(piece.to(param.dtype))
