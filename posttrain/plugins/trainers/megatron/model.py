"""Build a Megatron-core ``GPTModel`` from a spec, and move weights between it and HF checkpoints.

- :func:`init_parallel` sets up torch.distributed (gloo on CPU, NCCL on GPU) and Megatron's parallel state.
- :func:`build_gpt` makes the model (this rank's TP shards of this PP stage's layers) from ``spec`` + the
  HF config; :func:`megatron_params` names parameters with *global* layer indices on every stage.
- :func:`load_hf` copies an HF safetensors checkpoint into it, checking that every Megatron parameter is
  filled and every HF tensor is used (a mapping that forgets or invents a tensor fails loudly).
- :func:`iter_hf` yields the model as ``(hf_name, full tensor)`` with TP shards gathered;
  :func:`save_hf` writes a loadable HF checkpoint from it.

TP sharding is generic (:mod:`~posttrain.plugins.trainers.megatron.sharding`): a parameter Megatron marks ``tensor_model_parallel`` is split along its
``partition_dim``; a gated MLP's ``linear_fc1`` (``[gate; up]``, dense, routed or shared expert) is split
gate and up separately so each rank holds ``[gate_r; up_r]``, which is what Megatron's MLP chunks in two.
Routed experts are split over the expert-TP group (Megatron's default: the TP size) and, with EP, rank
``r`` of the EP group holds experts ``r * E/ep .. (r + 1) * E/ep - 1``: names are global
(:func:`megatron_params`), loading takes each rank's own, export all-gathers them over EP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.errors import UsageError
from posttrain.core.hf_init import HF_EXTRA_FILES, config_json
from posttrain.plugins.trainers.megatron import cpu_shims
from posttrain.plugins.trainers.megatron.optim import use_foreach_multi_tensor
from posttrain.plugins.trainers.megatron.sharding import (ep_info, gather, is_expert, mark_tp_params, shard, tp_group_of,
                                                       tp_info)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0, cp: int = 1, ep: int = 1) -> None:
    """torch.distributed from the torchrun (or trainer group) environment, else a one-process group, +
    Megatron parallel state: TP x CP x DP x PP, rank order ``tp-cp-ep-dp-pp`` (TP fastest).

    ``ep``: expert-parallel size. Megatron carves expert groups out of the data-parallel ranks (expert
    TP = ``tp``): the data-parallel size ``world / (tp * pp * cp)`` must be a multiple of ``ep``.
    """
    from megatron.core import parallel_state

    cpu_shims.install()
    use_foreach_multi_tensor()
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init = "env://" if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=init,
                                rank=rank, world_size=world)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            raise UsageError(f"model parallelism already initialized as tp={have[0]} pp={have[1]} cp={have[2]} "
                             f"ep={have[3]}, asked for tp={tp} pp={pp} cp={cp} ep={ep}")
    else:
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise UsageError(f"world size {world} is not a multiple of tp*pp*cp={tp * pp * cp}")
        if (world // (tp * pp * cp)) % ep:
            raise UsageError(f"ep={ep} needs a data-parallel size (world {world} / (tp*pp*cp={tp * pp * cp})) that "
                             f"is a multiple of it: run {tp * pp * cp * ep} ranks (or a multiple)")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    cpu_shims.init_rng(seed)


def megatron_config_fields() -> dict[str, set[str]]:
    """Field names settable through ``trainer.megatron``: TransformerConfig, DDP and optimizer configs."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    return {"transformer": {f.name for f in dataclasses.fields(TransformerConfig)},
            "ddp": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
            "optimizer": {f.name for f in dataclasses.fields(OptimizerConfig)}}


def split_megatron_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"transformer": {...}, "ddp": {...}, "optimizer": {...}}``; an unknown name is a UsageError."""
    from posttrain.core.errors import did_you_mean

    fields = megatron_config_fields()
    out: dict[str, dict[str, Any]] = {k: {} for k in fields}
    for key, value in (overrides or {}).items():
        owners = [k for k, names in fields.items() if key in names]
        if not owners:
            every = set().union(*fields.values())
            raise UsageError(f"trainer.backend.megatron.{key}: not a field of TransformerConfig, "
                             f"DistributedDataParallelConfig or OptimizerConfig.{did_you_mean(key, every)}")
        for k in owners:
            out[k][key] = value
    return out


def core_attention_for(kind: str) -> Any:
    """The ``core_attention`` module for ``kind`` (auto | sdpa | local | te); None keeps the spec's."""
    if kind == "auto":
        try:
            import transformer_engine  # noqa: F401

            kind = "te" if torch.cuda.is_available() else "sdpa"
        except ImportError:
            kind = "sdpa"
    if kind == "sdpa":
        from posttrain.plugins.trainers.megatron.attention import SDPAttention

        return SDPAttention
    if kind == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if kind == "local":
        return None
    raise UsageError(f"trainer.attention: unknown core attention {kind!r}; valid: auto, sdpa, local, te")


def build_gpt(spec: Any, hf: dict[str, Any], *, dtype: str = "float32", attention: str = "auto",
              transformer_overrides: dict[str, Any] | None = None, init_weights: bool = True, seed: int = 0,
              exact: bool = False) -> Any:
    """A ``GPTModel`` holding this rank's TP shards, on the current device. ``tp`` comes from parallel state.
    ``init_weights`` draws them from ``seed`` the same way on every device and layout (:mod:`.init`).
    ``exact``: norms, SwiGLU and core attention from ``posttrain.core.exact`` (the local engine's exact mode);
    its matmuls become batch-invariant under ``exact.mode()``, which the trainer's forward passes enter."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron.core import parallel_state

    _, tp = tp_info()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if hf["num_hidden_layers"] % pp:
        raise UsageError(f"pp={pp} does not divide the {hf['num_hidden_layers']} layers")
    torch_dtype = DTYPES[dtype]
    kwargs = spec.transformer_config(hf)
    kwargs.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                  expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                  params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
                  bf16=torch_dtype == torch.bfloat16, fp16=torch_dtype == torch.float16,
                  use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False)
    if pp > 1:  # packed micro-batches differ in length: stages exchange shapes before activations
        kwargs.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                      batch_p2p_comm=torch.cuda.is_available())  # gloo: plain isend/irecv
    kwargs.update(transformer_overrides or {})
    core_attention = core_attention_for(attention)
    if exact:
        from posttrain.core import exact as exact_ops
        from posttrain.plugins.trainers.megatron.exact_attention import ExactAttention

        kwargs.update(activation_func=exact_ops.silu, bias_activation_fusion=False)
        core_attention = ExactAttention
    layer_spec = spec.layer_spec(hf, core_attention)
    if kwargs.get("multi_latent_attention"):  # MLA's fields live on a subclass
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TransformerConfig
    config = TransformerConfig(**kwargs)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                     vocab_size=spec.padded_vocab_size(hf, tp), **spec.gpt_model_kwargs(hf),
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    mark_tp_params(model)
    if exact:
        from posttrain.plugins.trainers.megatron import exact_moe

        exact_ops.enable()
        exact_ops.patch_norms(model)
        exact_moe.install(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model = model.to(torch_dtype)
    if exact:  # the engine's tables, from the CPU: the model's rotary, or each MLA layer's own
        base = spec.gpt_model_kwargs(hf)["rotary_base"]
        for module in model.modules():
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                exact_ops.align_inv_freq(module.inv_freq, base)
    if init_weights:
        from posttrain.plugins.trainers.megatron.init import seeded_init

        seeded_init(model, spec, hf, seed)
    return model


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def megatron_params(model: Any) -> dict[str, torch.Tensor]:
    """This rank's trainable parameters by *global* Megatron name, wrappers such as DDP's ``module.``
    prefix stripped: ``decoder.layers.<global layer>`` (with PP a stage numbers its layers from 0) and
    ``mlp.experts.local_experts.<global expert>`` (with EP a rank numbers its experts from 0). MoE
    routers' ``expert_bias`` buffers are included (loaded and exported like weights, never trained); LoRA adapters
    are not (:mod:`~posttrain.plugins.trainers.megatron.lora`)."""
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    offsets = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(inner.decoder.layers)}
    config = inner.config
    ep_rank, ep = ep_info() if config.num_moe_experts else (0, 1)
    first_expert = ep_rank * (config.num_moe_experts or 0) // ep
    named = list(inner.named_parameters())
    named += [(n, b) for n, b in inner.named_buffers() if n.endswith("router.expert_bias")]
    out = {}
    for name, param in named:
        if ".lora_" in name:  # LoRA adapters (megatron.lora): not the model's HF-mapped weights
            continue
        if name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            name = f"decoder.layers.{offsets[index]}.{rest}"
            if first_expert:
                name = _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + first_expert}.", name)
        out[name] = param
    return out


def pp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def _tied_copy(spec: Any, hf: dict[str, Any], name: str) -> bool:
    """The last PP stage's own copy of a tied output layer (kept equal to the embedding by Megatron)."""
    return name == "output_layer.weight" and spec.tied(hf)


class HFCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as exc:  # noqa: BLE001 - a truncated or foreign file is the user's to fix
                raise UsageError(f"{f}: not a readable safetensors file ({exc})") from None
        self.where = {k: f for f, h in self._handles.items() for k in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise UsageError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self._handles[self.where[name]].get_tensor(name)

    def names(self) -> set[str]:
        return set(self.where)


def load_hf(model: Any, spec: Any, hf: dict[str, Any], path: str | Path) -> None:
    """Fill ``model`` (this rank's shards) from the HF checkpoint at ``path``; check coverage both ways
    (collective over the world when the model is split over PP or EP ranks)."""
    ckpt = HFCheckpoint(path)
    params = megatron_params(model)
    expected = set(spec.megatron_names(hf))
    have = {n for n in params if not _tied_copy(spec, hf, n)}
    have_all = _mp_union(have)
    if expected != have_all:
        raise UsageError(f"{spec.name}: spec parameters and model parameters differ: "
                         f"missing in model {sorted(expected - have_all)[:4]}, "
                         f"unmapped in spec {sorted(have_all - expected)[:4]}")
    used: set[str] = set()
    with torch.no_grad():
        for name, param in params.items():
            rank, tp, _ = tp_group_of(name)
            source_name = "embedding.word_embeddings.weight" if _tied_copy(spec, hf, name) else name
            sources = spec.hf_sources(hf, source_name)
            used.update(sources)
            full = spec.to_megatron(hf, source_name, [ckpt.get(s) for s in sources])
            if name in VOCAB_PARAMS and full.shape[0] < param.shape[0] * tp:  # TP-dependent vocab padding
                full = torch.cat([full, full.new_zeros(param.shape[0] * tp - full.shape[0], *full.shape[1:])])
            piece = shard(name, param, full, rank, tp)
            if tuple(piece.shape) != tuple(param.shape):
                raise UsageError(f"{path}: {name}: shape {tuple(piece.shape)} from {sources} does not fit the "
                                 f"model's {tuple(param.shape)} (does config.json match the weights?)")
            param.copy_(piece.to(param.dtype))
    used = _mp_union(used)
    ignored = getattr(spec, "ignored_hf_tensor", lambda hf, name: False)
    skipped = {n for n in ckpt.names() - used if ignored(hf, n)}
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"{spec.name}: skipping {len(skipped)} checkpoint tensors no Megatron parameter takes (layers past "
              f"num_hidden_layers={hf['num_hidden_layers']}: multi-token prediction)", flush=True)
    unused = {n for n in ckpt.names() - used - skipped if not n.endswith("rotary_emb.inv_freq")}
    if spec.tied(hf):
        unused.discard("lm_head.weight")
    if unused:
        raise UsageError(f"{path}: {len(unused)} checkpoint tensors are not used by spec {spec.name!r}, "
                         f"e.g. {sorted(unused)[:3]}")


def _mp_union(names: set[str]) -> set[str]:
    """The union of ``names`` over every rank when PP stages or EP ranks hold different parameters."""
    from megatron.core import parallel_state

    if pp_size() == 1 and parallel_state.get_expert_model_parallel_world_size() == 1:
        return set(names)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sorted(names))
    return set().union(*map(set, parts))


def _full_tensors(model: Any, spec: Any, hf: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(megatron name, unsharded tensor)`` of this stage: TP shards gathered, and with EP every
    expert of a layer (all-gathered over the EP group, in global order) where this rank holds some."""
    from megatron.core import parallel_state

    params = {n: p for n, p in megatron_params(model).items() if not _tied_copy(spec, hf, n)}
    _, ep = ep_info()
    done: set[str] = set()
    for name, param in params.items():
        if ep == 1 or not is_expert(name):
            yield name, gather(name, param)
            continue
        layer = name[: name.index(".mlp.experts.")]
        if layer in done:
            continue
        done.add(layer)
        prefix = f"{layer}.mlp.experts.local_experts."
        mine = sorted({int(n[len(prefix):].split(".")[0]) for n in params if n.startswith(prefix)})
        for kind in ("linear_fc1.weight", "linear_fc2.weight"):
            local = torch.stack([gather(f"{prefix}{e}.{kind}", params[f"{prefix}{e}.{kind}"]) for e in mine])
            parts = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(parts, local.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            for r, part in enumerate(parts):
                for j, tensor in enumerate(part):
                    yield f"{prefix}{r * len(mine) + j}.{kind}", tensor


def iter_hf(model: Any, spec: Any, hf: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every weight, TP shards gathered, EP experts gathered; with PP every
    stage's weights, stage by stage, on every rank (collective: call on every rank of the model)."""
    from megatron.core import parallel_state

    own = _full_tensors(model, spec, hf)
    if pp_size() == 1:
        for name, tensor in own:
            yield from spec.to_hf(hf, name, tensor)
        return
    mine = [(hf_name, t.cpu()) for name, tensor in own for hf_name, t in spec.to_hf(hf, name, tensor)]
    group = parallel_state.get_pipeline_model_parallel_group()
    for stage in range(pp_size()):
        box = [mine if parallel_state.get_pipeline_model_parallel_rank() == stage else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, stage), group=group)
        yield from box[0]


def save_hf(model: Any, spec: Any, hf: dict[str, Any], out_dir: str | Path, *, dtype: str | None = None,
            source_dir: str | Path | None = None, shard_bytes: int = 5 << 30,
            tensors: Iterator[tuple[str, torch.Tensor]] | None = None) -> Path | None:
    """Write an HF checkpoint (``config.json`` + safetensors shards + index) from rank 0; tokenizer files
    are copied from ``source_dir`` when given. Collective over TP; returns the path on rank 0. ``tensors``: the
    ``(hf_name, tensor)`` to write instead of :func:`iter_hf`'s (LoRA's merged weights)."""
    from safetensors.torch import save_file

    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in (iter_hf(model, spec, hf) if tensors is None else tensors):
        if not is_writer:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        t = tensor.detach().to("cpu")
        shards[-1][name] = t.to(DTYPES[dtype]) if dtype else t
        size += nbytes
    if not is_writer:
        return None
    out.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(t.numel() * t.element_size() for p in shards for t in p.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    first = next(iter(next(iter(shards)).values()), None)
    written_dtype = dtype or (str(first.dtype).removeprefix("torch.") if first is not None else "float32")
    (out / "config.json").write_text(json.dumps(config_json(spec, hf, written_dtype), indent=2))
    if source_dir:
        for fname in HF_EXTRA_FILES:
            if (Path(source_dir) / fname).is_file():
                shutil.copy(Path(source_dir) / fname, out / fname)
    return out
