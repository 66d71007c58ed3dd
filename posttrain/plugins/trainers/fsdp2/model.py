"""``FSDP2Model``: any HF causal LM the RL loop trains, sharded with torch FSDP2 (``fully_shard``).

The loop's calls (shapes in :mod:`posttrain.core.train_batch`; every per-token tensor ``[B, T]``)::

    model = FSDP2Model(spec, run.trainer, backend=fsdp2_config, seed=0)
    lp, ent = model.log_probs(batch, with_entropy=True)    # [B, T] fp32 each; weights="ref" for the reference
    metrics = model.train_step(batch, loss_fn)             # micro-batches, clipping, lr schedule, one AdamW step
    for bucket in model.export_hf(1 << 30): ...            # [(hf_name, full tensor)]: a collective
    model.save(dir); model.load(dir); model.save_hf(dir)

Weights: ``AutoModelForCausalLM`` from the spec's checkpoint or, from its ``config.json`` mapping, a random
init after ``torch.manual_seed(seed)`` (every rank draws the same; residual-output projections scaled by
``1 / sqrt(2 L)`` as Megatron draws them, :func:`scale_residual_outputs`). Parameters are held in float32 and
sharded over the group's ranks (each decoder layer, named by the model's ``_no_split_modules``, then the
root); forward and backward compute in ``param_dtype`` (``auto``: the spec's dtype) and gradients are
reduce-scattered in ``reduce_dtype``; AdamW updates the float32 shards (the master weights).

Log-probs: ``log_probs[b, t] = z[b, t - 1, tokens[b, t]] - logsumexp(z[b, t - 1])`` from the model's own
logits (so soft-capping or logit scaling of an architecture is kept), 0 at column 0 and past each
length; entropy ``H = logsumexp(z) - sum softmax(z) z``. With ``sequence_packing`` (:mod:`.packing`) a
micro-batch's samples run as one row, positions restarting at 0 in each and attention kept within each, and
the per-token results go back to their ``[b, T]`` columns; otherwise samples are right-padded and run without
an attention mask: under causal attention a real token never sees the padding after it.

Loss: the run's policy loss plus KL and entropy terms (:func:`posttrain.core.losses.total_loss`), each
micro-batch's normalized by the step's global token and sample counts, so micro-batch and data-parallel
splits give the same step up to summation order; FSDP averages gradients over the ranks, so the loss is
scaled by the rank count to make that average a sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.core.losses import entropy_from_logits, total_loss
from posttrain.core.train_batch import Packed, TrainBatch, pack
from posttrain.core.trainer_backend import lr_at
from posttrain.plugins.trainers.fsdp2 import packing, parallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUMMED_METRICS = {"kl_loss": "kl", "entropy": "entropy"}  # total_loss's terms: micro-batch shares that sum
SUMMED = set(SUMMED_METRICS.values())


def build_hf_model(spec: Any, seed: int, scaled_output_init: bool = True) -> torch.nn.Module:
    """The spec's HF model in float32: its checkpoint, or a random init from ``spec.hf_config()`` (transformers'
    own, then :func:`scale_residual_outputs` with ``scaled_output_init``); ``AutoModelForImageTextToText`` for a
    vision-language config (a ``vision_config``), else ``AutoModelForCausalLM``."""
    import transformers

    from posttrain.core.vision import is_vision_config

    hf = spec.hf_config()
    auto = transformers.AutoModelForImageTextToText if is_vision_config(hf) else transformers.AutoModelForCausalLM
    if spec.config.path:
        return auto.from_pretrained(spec.config.path, dtype=torch.float32)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    config = transformers.AutoConfig.for_model(hf["model_type"], **kwargs)
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    if scaled_output_init:
        scale_residual_outputs(model)
    return model


def scale_residual_outputs(model: torch.nn.Module) -> int:
    """Scale each decoder block's residual-stream writers by ``1 / sqrt(2 L)`` (``L`` blocks): in every direct child
    of a block (attention, MLP), the last ``nn.Linear`` whose output width is the hidden size (``o_proj``,
    ``down_proj``, ``dense_4h_to_h``, a MoE's shared-expert ``down_proj``). A weight drawn ``N(0, s^2)`` becomes
    ``N(0, s^2 / 2L)``: Megatron's (and GPT-2's) output-layer init, which keeps the residual stream's variance
    from growing with depth. Returns the weights scaled."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    hidden, count = getattr(model.config, "hidden_size", None), 0
    with torch.no_grad():
        for layer in layers:
            for child in layer.children():
                writers = [m for m in child.modules() if isinstance(m, torch.nn.Linear) and m.out_features == hidden]
                if writers:
                    writers[-1].weight.mul_((2 * len(layers)) ** -0.5)
                    count += 1
    return count


class FSDP2Model:
    """An FSDP2-sharded HF causal LM (the actor) with its AdamW and reference weights."""

    dp_rank = 0  # the trainer role's replica: FSDP's ranks together hold one copy of the weights

    def __init__(self, spec: Any, config: Any, *, backend: Any, seed: int = 0, role: str = "actor",
                 max_response_len: int | None = None):
        """``config``: the run's ``trainer`` section; ``backend``: ``trainer.backend`` (FSDP2Backend.Config)."""
        if role != "actor":
            raise NotImplementedError("the fsdp2 trainer trains the actor only (no critic: use the megatron backend "
                                      "for estimators that need one)")
        parallel.init_group()
        self.spec, self.config, self.backend, self.role = spec, config, backend, role
        self.max_response_len = max_response_len
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = DTYPES[spec.config.dtype]  # of what leaves: export_hf, save_hf
        model = build_hf_model(spec, seed, backend.scaled_output_init)
        model.config.use_cache = False
        self.pixels = self._vision(model, spec)
        self.packed = packing.resolve(backend.sequence_packing, spec.hf_config())
        if self.packed:  # every forward runs packed rows through the varlen attention
            packing.register()
            model.set_attn_implementation(packing.ATTENTION)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.architecture = type(model).__name__  # before fully_shard renames the class (FSDP<name>)
        if backend.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = config.lora if config.lora.enabled else None
        if self.lora is not None:  # peft adapters; the base weights frozen
            from posttrain.plugins.trainers.fsdp2 import lora

            model = lora.wrap(model, self.lora)
        self.model = shard(model.to(self.device), self._param_dtype(), DTYPES[backend.reduce_dtype],
                           cpu_offload=backend.cpu_offload and self.device.type == "cuda")
        # what trains: every weight but a frozen vision tower's, or (LoRA) the adapters only; the optimizer,
        # clipping and snapshots take these
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        c = config
        self.optimizer = torch.optim.AdamW(self.trainable, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2),
                                           eps=c.adam_eps, weight_decay=c.weight_decay)
        self.step = 0
        self._snapshots: dict[str, list[torch.Tensor]] = {}
        if config.uses_reference:  # no KL term and no log_kl: no copy to keep
            self.snapshot("ref")

    def _vision(self, model: torch.nn.Module, spec: Any) -> Any:
        """A vision-language model's :class:`~.vision.PixelInputs` (its tower frozen with ``freeze_vision``), or
        None for a text model."""
        from posttrain.plugins.trainers.fsdp2 import vision

        if vision.vision_tower(model) is None:
            return None
        if not spec.config.path:
            raise ValueError("a vision-language model needs model.path: its image processor comes from the checkpoint")
        if self.backend.freeze_vision:
            vision.freeze_vision(model)
        pixels = vision.PixelInputs(spec.config.path, self._param_dtype())
        pixels.attach(model)
        return pixels

    def _param_dtype(self) -> torch.dtype:
        name = self.backend.param_dtype
        return self.dtype if name == "auto" else DTYPES[name]

    # ------------------------------------------------------------------ forward
    def _forward(self, mb: TrainBatch, with_entropy: bool, row: Packed | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [b, T], entropy [b, T] | None)`` of micro-batch ``mb`` (on the device), with autograd;
        ``row``: its samples packed into one row (on the device), or None for padded rows."""
        if row is not None:
            logits = self.model(**packing.forward_kwargs(row), use_cache=False).logits[0].float()  # [N, V]
            target = row.targets
        else:
            ids, extra = (mb.tokens, {}) if self.pixels is None else self.pixels.prepare(self.model, mb.tokens,
                                                                                        mb.images)
            logits = self.model(input_ids=ids, use_cache=False, **extra).logits[:, :-1].float()  # [b, T-1, V]
            target = mb.tokens[:, 1:]
        if mb.logit_scale != 1.0:  # the rollout's temperature: log_softmax(z / T)
            logits = logits * mb.logit_scale
        lp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
        ent = entropy_from_logits(logits) if with_entropy else None
        if row is not None:  # a sample's position i predicts its token i + 1: column i + 1 of its [T] row
            lengths = torch.tensor(row.cu_host[1:]) - torch.tensor(row.cu_host[:-1])  # host: no device sync
            out = [row.unpack(v, lengths, mb.tokens.shape[1]) for v in (lp, ent) if v is not None]
        else:
            cols = valid_columns(mb)
            out = [torch.nn.functional.pad(v, (1, 0)) * cols for v in (lp, ent) if v is not None]
        return out[0], out[1] if with_entropy else None

    def _micro_batches(self, part: TrainBatch) -> list[tuple[TrainBatch, list[int], bool, Packed | None]]:
        """``(micro-batch on the device, its rows of part, is_real, its packed row or None)``."""
        c, out = self.config, []
        for index, real in parallel.micro_batches(part, c.micro_batch_size, c.max_tokens_per_micro_batch,
                                                  self.packed):
            mb = part.take(index)
            row = _to(pack(mb.tokens, mb.lengths), self.device) if self.packed else None
            out.append((mb.to(self.device), index, real, row))
        return out

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, with_entropy: bool = False, weights: str | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [B, T], entropy [B, T] | None)``, float32 on the CPU; ``weights="ref"`` (or any
        :meth:`snapshot` tag) uses those weights. Each rank computes its share; every rank returns all."""
        part, index = parallel.share(batch)
        lp_out = torch.zeros(part.tokens.shape)
        ent_out = torch.zeros(part.tokens.shape) if with_entropy else None
        with self._weights(weights):
            self.model.eval()
            for mb, rows, real, row in self._micro_batches(part):
                lp, ent = self._forward(mb, with_entropy, row)
                if real:
                    lp_out[rows, : lp.shape[1]] = lp.cpu()
                    if ent_out is not None:
                        ent_out[rows, : ent.shape[1]] = ent.cpu()
        return parallel.gather((lp_out, ent_out), index, batch)

    # ------------------------------------------------------------------ reference weights
    def snapshot(self, tag: str) -> None:
        """Keep a copy of this rank's shards of the current trainable weights under ``tag`` (``"ref"``: at build;
        with LoRA the adapters only, as the frozen base never changes)."""
        self.model.reshard()  # the root stays unsharded after a forward: its parameters as shards again
        self._snapshots[tag] = [p.detach().clone() for p in self.trainable]

    @contextmanager
    def _weights(self, tag: str | None):
        if tag is None:
            yield
            return
        if tag not in self._snapshots:
            raise KeyError(f"no weights snapshot {tag!r}; have: {', '.join(self._snapshots) or 'none'}")
        self.model.reshard()
        shards = [_local(p) for p in self.trainable]  # views of FSDP's sharded storage
        current = [t.detach().clone() for t in shards]
        with torch.no_grad():
            for t, ref in zip(shards, self._snapshots[tag]):
                t.copy_(_local(ref))
        try:
            yield
        finally:
            self.model.reshard()
            with torch.no_grad():
                for t, cur in zip(shards, current):
                    t.copy_(cur)

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: Callable[..., Any] | None = None, **loss_kwargs: Any,
                   ) -> dict[str, float]:
        """One AdamW step over ``batch``: ``loss``, ``grad_norm``, ``lr``, ``kl``, ``entropy`` and the
        loss's own metrics (``pg/...``), the same on every rank."""
        if loss_fn is None:
            raise ValueError("train_step: the actor needs a loss_fn")
        c = self.config
        part, _ = parallel.share(batch)
        lr = lr_at(self.step, c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        global_tokens = parallel.all_sum(float(part.response_mask.sum()), self.device)
        global_seqs = parallel.all_sum(float(len(part)), self.device)
        scale = float(parallel.rank_size()[1])  # FSDP averages gradients over the ranks: make it a sum
        totals: dict[str, float] = {}
        for mb, _, real, row in self._micro_batches(part):
            loss, metrics = self._policy_loss(mb, row, loss_fn, global_tokens, global_seqs, loss_kwargs)
            (loss * (scale if real else 0.0)).backward()
            if not real:
                continue
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * (1.0 if k in SUMMED else len(mb) / len(part))
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, c.grad_clip if c.grad_clip else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.step += 1
        totals = parallel.reduce_metrics(totals, len(part), global_seqs, SUMMED)
        return {**totals, "grad_norm": norm, "lr": lr}

    def _policy_loss(self, mb: TrainBatch, row: Packed | None, loss_fn: Any, global_tokens: float,
                     global_seqs: float, loss_kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        if c.kl_loss_coef and mb.ref_log_probs is None:
            raise ValueError("train_step: kl_loss_coef > 0 needs batch.ref_log_probs")
        lp, ent = self._forward(mb, c.entropy_coef != 0.0, row)
        old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
        pg, metrics = loss_fn(lp, old, mb.advantages, mb.response_mask, is_weights=mb.is_weights,
                              global_tokens=global_tokens, global_seqs=global_seqs, **loss_kwargs)
        loss_cfg = getattr(loss_fn, "config", None)
        total, terms = total_loss(
            pg, mb.response_mask, log_probs=lp if c.kl_loss_coef else None,
            ref_log_probs=mb.ref_log_probs if c.kl_loss_coef else None, entropy=ent, kl_loss_coef=c.kl_loss_coef,
            kl_kind=c.kl_kind, entropy_coef=c.entropy_coef, aggregation=getattr(loss_cfg, "aggregation", "token-mean"),
            global_tokens=global_tokens, global_seqs=global_seqs,
            max_response_len=getattr(loss_cfg, "max_response_len", None) or self.max_response_len)
        out = {f"pg/{k}" if "/" not in k else k: v for k, v in dict(metrics or {}).items()}
        out.update({SUMMED_METRICS[k]: v for k, v in terms.items() if k in SUMMED_METRICS})
        return total, out

    # ------------------------------------------------------------------ weights out
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        if hasattr(t, "full_tensor"):  # a DTensor shard (on the host under cpu_offload)
            t = (t if t.device == self.device else t.to(self.device)).full_tensor()
        return t.detach()

    def _full_named(self, view: str = "merged", scaling: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor in the export dtype)``, every rank gathering each in turn (a collective).
        With LoRA, ``view`` picks merged weights, base weights + adapters, or adapters only
        (:func:`posttrain.plugins.trainers.fsdp2.lora.hf_tensors`; ``scaling`` defaults to alpha / r)."""
        self.model.reshard()
        named: Iterator[tuple[str, torch.Tensor]] = iter(self.model.state_dict().items())
        if self.lora is None:
            named = ((name, self._gather(t)) for name, t in named)
        else:
            from posttrain.plugins.trainers.fsdp2.lora import hf_tensors

            scale = self.lora.scaling if scaling is None else scaling
            named = hf_tensors(named, view, scale, self._gather)
        for name, t in named:
            if self.tied and name == "lm_head.weight":  # the embedding carries a tied output layer
                continue
            yield name, t.to(self.dtype)

    def export_hf(self, bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets ``[(hf_name, tensor)]`` of at most ``bucket_bytes`` (a larger tensor alone), in the
        spec's dtype, on every rank (call it on every rank: each tensor is gathered from all). With LoRA the
        merged weights ``W + (alpha / r) B @ A``."""
        from posttrain.core.rollout.weight_sync import tensor_buckets

        yield from tensor_buckets(self._full_named(), bucket_bytes)

    def export_update(self, bucket_bytes: int = 1 << 30, full: bool = True,
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weight push's buckets: :meth:`export_hf` without LoRA; with it, the base weights and the adapter
        pairs when ``full`` (a first push), else the adapter pairs only (:mod:`posttrain.core.lora`)."""
        from posttrain.core.rollout.weight_sync import tensor_buckets

        view = "merged" if self.lora is None else ("base" if full else "adapters")
        yield from tensor_buckets(self._full_named(view), bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path:
        """An HF checkpoint (config.json + safetensors, the spec's dtype) written by rank 0; a collective."""
        from posttrain.plugins.trainers.fsdp2.checkpoint import save_hf

        return save_hf(self, out_dir)

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str | Path) -> None:
        """Weights, optimizer state, reference and step (torch.distributed.checkpoint); a collective."""
        from posttrain.plugins.trainers.fsdp2.checkpoint import save

        save(self, ckpt_dir)

    def load(self, ckpt_dir: str | Path) -> None:
        """What :meth:`save` wrote, at this group's size (any data-parallel size may have written it)."""
        from posttrain.plugins.trainers.fsdp2.checkpoint import load

        load(self, ckpt_dir)


def shard(model: torch.nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
          cpu_offload: bool = False) -> torch.nn.Module:
    """``fully_shard`` each decoder layer (the classes in ``model._no_split_modules``), then the root, over
    a one-dimensional mesh of every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _to(row: Packed, device: torch.device) -> Packed:
    """A packed row's tensors on ``device`` (its host offsets stay)."""
    from dataclasses import replace

    return replace(row, input_ids=row.input_ids.to(device), position_ids=row.position_ids.to(device),
                   targets=row.targets.to(device), cu_seqlens=row.cu_seqlens.to(device))


def valid_columns(mb: TrainBatch) -> torch.Tensor:
    """``[b, T]`` 1.0 on columns ``1 <= t < lengths[b]`` (a token with a prefix), else 0."""
    cols = torch.arange(mb.tokens.shape[1], device=mb.tokens.device)[None]
    return ((cols >= 1) & (cols < mb.lengths.to(cols.device)[:, None])).float()
