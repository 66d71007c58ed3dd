"""``MegatronTrainer``: the policy (or critic) model the RL loop trains, on Megatron-core.

The loop calls (shapes in :mod:`posttrain.core.train_batch`; every per-token tensor ``[B, T]``)::

    trainer = MegatronTrainer(spec, trainer_config, backend=megatron_config)  # GPTModel (TP/PP), spec's HF path
    lp, ent = trainer.log_probs(batch, with_entropy=True)      # [B, T] fp32 each; weights="ref" for reference
    metrics = trainer.train_step(batch, loss_fn)               # micro-batches, clip, LR schedule, one step
    for bucket in trainer.export_hf(bucket_bytes=1 << 30): ... # [(hf_name, tensor)], TP gathered
    trainer.save(dir); trainer.load(dir); trainer.save_hf(dir)

``loss_fn(log_probs, old_log_probs, advantages, response_mask, is_weights=None, global_tokens=None,
global_seqs=None) -> (scalar loss, metrics)`` is the Algorithms contract: micro-batch losses computed
with the whole batch's ``global_tokens``/``global_seqs`` sum to the full-batch loss. The KL (against
``batch.ref_log_probs``) and entropy terms come from :func:`posttrain.core.losses.total_loss`, aggregated
in the loss's own mode with the same global counts.

Parallelism: TP shards inside every layer; PP (``trainer.backend.pp``) splits the layers into stages run by
Megatron's 1F1B schedule (packed micro-batches; results are broadcast from the last stage, so every
rank returns the same tensors); ranks beyond ``tp * pp`` are data-parallel: every rank is passed the
whole batch and takes its replica's share, balanced by token count (:mod:`.data_parallel`); losses are
normalized by the global token count, gradients summed over DP, results gathered back in sample order.
MoE models (:mod:`~posttrain.plugins.trainers.megatron.moe`): EP (``trainer.backend.ep``) splits the
experts over ``ep`` of the data-parallel ranks (their gradients summed over the expert-data-parallel ranks
only); ``trainer.backend.routing_replay`` routes with ``batch.routed_experts``; ``train_step`` adds
``moe_aux_loss`` and ``moe_load_imbalance/layer_<l>``.

On CPU: a torch AdamW (fp32 master weights for bf16/fp16 parameters) and our own grad clipping. On GPU: Megatron's DDP and
(distributed) optimizer. The reference policy is a copy of the initial weights (:mod:`.snapshots`: on the
device when it fits, ``trainer.backend.ref_offload``), swapped in for ``log_probs(..., weights="ref")``
without copying the policy's weights (slime keeps such backups in the same actor too). It is kept only when the
run uses it (``TrainerConfig.uses_reference``: a KL term or ``log_kl``), as slime loads no reference at KL 0. ``offload()``/``onload()``
(:mod:`.offload`, ``resources.offload_trainer``) move that state (all of it, or the ``trainer.backend.offload_parts``
named) to host memory and back while a colocated engine generates.

Micro-batches: ``trainer.micro_batch_size`` samples each, or with ``trainer.max_tokens_per_micro_batch``
consecutive samples up to that many tokens (:func:`micro_batch_bounds`). Losses are normalized by the
whole batch's token and sample counts, so any split gives the same loss and gradients.
``train_step(..., keep_log_probs=True)`` also returns the training forward's log-probs and entropy
(detached, before the update): the old policy's when the batch is trained in this one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from posttrain.core.errors import UsageError
from posttrain.core.losses import total_loss
from posttrain.core.trainer_backend import lr_at
from posttrain.plugins.trainers.megatron import checkpoint, data_parallel, dedup, grads, offload, pipeline, rope
from posttrain.plugins.trainers.megatron import model as M
from posttrain.plugins.trainers.megatron.compiled import compiled_layer
from posttrain.core.train_batch import TrainBatch, pack
from posttrain.core import exact
from posttrain.plugins.trainers.megatron.logprobs import vocab_parallel_log_probs
from posttrain.plugins.trainers.megatron.moe import MoERuntime, moe_overrides
from posttrain.plugins.trainers.megatron.optim import use_fused_adam
from posttrain.plugins.trainers.megatron.options import MegatronConfig
from posttrain.plugins.trainers.megatron.snapshots import Snapshots


# total_loss's terms, renamed as train/ metrics: micro-batch shares of the batch value, summed (not averaged)
SUMMED_METRICS = {"kl_loss": "kl", "entropy": "entropy"}
SUMMED = set(SUMMED_METRICS.values())


class MegatronTrainer:
    """A Megatron-core GPTModel (policy, or critic with ``role="critic"``) with its optimizer."""

    def __init__(self, spec: Any, config: Any = None, *, backend: Any = None, seed: int = 0, role: str = "actor",
                 load_weights: bool = True, max_response_len: int | None = None, exact: bool = False):
        """``config``: the run's ``trainer`` section (algorithm keys); ``backend``: this backend's own
        (``trainer.backend``: parallelism, attention, compile, optimizer kernels, Megatron pass-through).
        ``exact``: the forward passes compute with ``posttrain.core.exact`` (``rollout.exact``)."""
        from posttrain.core.config import TrainerConfig

        self.spec, self.config = spec, config or TrainerConfig()
        self.backend = backend or MegatronConfig()
        self.role, self._packed = role, self.backend.sequence_packing and self.backend.attention != "local"
        self.max_response_len, self.exact = max_response_len, exact
        self.hf = spec.hf_config()
        self.dtype = spec.config.dtype
        overrides = M.split_megatron_overrides({**self.backend.megatron, **moe_overrides(self.backend)})
        if self.config.deterministic and torch.cuda.is_available():  # a seeded GPU run repeats
            from posttrain.plugins.trainers.megatron.determinism import use_deterministic_kernels

            use_deterministic_kernels()
            overrides["transformer"].setdefault("deterministic_mode", True)
        M.init_parallel(self.backend.tp, self.backend.pp, seed=seed, cp=self.backend.cp, ep=self.backend.ep)
        self.tp_rank, self.tp_size = M.tp_info()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        has_ckpt = bool(spec.config.path) and load_weights
        self.model = M.build_gpt(spec, self.hf, dtype=self.dtype, attention=self.backend.attention,
                                 transformer_overrides=overrides["transformer"], init_weights=not has_ckpt,
                                 seed=seed, exact=exact)
        if has_ckpt:
            M.load_hf(self.model, spec, self.hf, spec.config.path)
        self.lora_modules: dict[str, Any] = {}  # LoRA: adapted linears by Megatron name; the rest is frozen
        if self.config.lora.enabled and role == "actor":
            from posttrain.plugins.trainers.megatron import lora

            self.lora_modules = lora.add_adapters(self.model, self.config.lora, seed)
        self.moe = MoERuntime(self.model, self.backend.routing_replay, self._packed, self.device)
        config = self.gpt.config
        self._dedup = (self.backend.dedup_inputs and not self._packed and not self.moe.routers
                       and not config.hidden_dropout and not config.attention_dropout)
        if self._packed:  # THD rotary from cu_seqlens as tensors: no host sync per layer, no recompiles
            rope.install()
        if self.backend.compile:  # before DDP wrapping; graph breaks (packed cu_seqlens) are fine
            for layer in self.model.decoder.layers:
                layer.forward = compiled_layer(layer.forward, symbolic_tokens=self._packed)
        self.value_head = None
        if role == "critic":  # replicated over TP, fp32; initialized to zero so initial values are 0
            self.value_head = torch.nn.Linear(self.hf["hidden_size"], 1, device=self.device, dtype=torch.float32)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        self.step = 0
        self._build_optimizer(overrides)
        self._offload = offload.TrainerOffload(self, self.device)
        self._snapshots = Snapshots(self._snapshot_params, self.device, self.backend.ref_offload)
        if role == "actor" and self.config.uses_reference:  # no KL term and no log_kl: no copy to keep
            self.snapshot("ref")

    def _snapshot_params(self) -> dict[str, torch.Tensor]:
        """What a snapshot copies: every weight, or (LoRA) the adapters, the only weights that change."""
        if self.lora_modules:
            from posttrain.plugins.trainers.megatron.lora import adapter_params

            return adapter_params(self.lora_modules)
        return M.megatron_params(self.model)

    # ------------------------------------------------------------------ optimizer
    def _params(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return params + (list(self.value_head.parameters()) if self.value_head is not None else [])

    def _build_optimizer(self, overrides: dict[str, dict[str, Any]]) -> None:
        c, b = self.config, self.backend
        self._masters: list[torch.Tensor] | None = None
        self.megatron_optimizer = torch.cuda.is_available()
        if self.megatron_optimizer:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                                                   "use_distributed_optimizer": b.use_distributed_optimizer,
                                                   **overrides["ddp"]})
            self.model = DistributedDataParallel(config=self.model.config, ddp_config=ddp, module=self.model)
            opt = OptimizerConfig(**{"optimizer": "adam", "lr": c.lr, "min_lr": c.min_lr,
                                     "weight_decay": c.weight_decay, "adam_beta1": c.adam_beta1,
                                     "adam_beta2": c.adam_beta2, "adam_eps": c.adam_eps, "clip_grad": c.grad_clip,
                                     "bf16": self.dtype == "bfloat16", "fp16": self.dtype == "float16",
                                     "params_dtype": M.DTYPES[self.dtype],
                                     "use_distributed_optimizer": b.use_distributed_optimizer,
                                     **overrides["optimizer"]})
            self.optimizer = get_megatron_optimizer(opt, [self.model])
            if b.fused_adam:
                use_fused_adam(self.optimizer)
            if self.value_head is not None:
                self.head_optimizer = torch.optim.AdamW(self.value_head.parameters(), lr=c.lr)
        else:
            # bf16/fp16 parameters keep fp32 master copies: an lr-1e-6 update vanishes in bf16.
            params = self._params()
            self._masters = ([p.detach().float().clone().requires_grad_(True) for p in params]
                             if any(p.dtype != torch.float32 for p in params) else None)
            self.optimizer = torch.optim.AdamW(self._masters or params, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2),
                                               eps=c.adam_eps, weight_decay=c.weight_decay)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (replicas hold the same weights)."""
        return data_parallel.dp_rank_size()[0]

    @property
    def gpt(self) -> Any:
        """The bare GPTModel (inside DDP on GPU)."""
        inner = self.model
        while not hasattr(inner, "decoder"):
            inner = inner.module
        return inner

    # ------------------------------------------------------------------ forward
    @contextmanager
    def _hidden_only(self):
        """Make GPTModel return final hidden states ``[b, s, h]``: its output layer becomes identity."""
        layer = getattr(self.gpt, "output_layer", None)
        if layer is None:  # not the last pipeline stage: the model already returns hidden states
            yield
            return
        layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None, **_: (hidden_states, None)
        try:
            yield
        finally:
            del layer.forward

    def _output_weight(self) -> torch.Tensor:
        gpt = self.gpt
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        from posttrain.plugins.trainers.megatron.lora import output_weight

        return output_weight(gpt.output_layer, gpt.output_layer.weight)

    def _hidden(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(hidden [N, H], targets [N], unpack)``: one row per packed micro-batch, or padded rows."""
        tokens, lengths = mb.tokens.to(self.device), mb.lengths.to(self.device)
        width = tokens.shape[1]
        with self._hidden_only():
            if self._packed:
                from megatron.core.packed_seq_params import PackedSeqParams

                p = pack(tokens, lengths)
                psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                                      max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len)
                psp.cu_seqlens_host = p.cu_host  # read by SDPAttention: no device sync per layer
                hidden = self.model(p.input_ids, p.position_ids, attention_mask=None, packed_seq_params=psp)[0]
                return hidden, p.targets, lambda v: p.unpack(v, lengths.cpu(), width)
            distinct, inverse = dedup.distinct_rows(tokens, lengths) if self._dedup else (tokens, None)
            positions = torch.arange(width, device=self.device).unsqueeze(0).expand_as(distinct)
            causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=self.device), 1)[None, None]
            hidden = self.model(distinct, positions, attention_mask=causal)  # [U, T, H]
            if inverse is not None:  # samples of the same inputs share their hidden states
                hidden = hidden.index_select(0, inverse)  # [B, T, H]
        targets = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)

        def unpack(v: torch.Tensor) -> torch.Tensor:
            v = v.reshape(tokens.shape)
            out = torch.zeros_like(v)
            out[:, 1:] = v[:, :-1]
            return out * (torch.arange(width, device=v.device)[None] < lengths[:, None])

        return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), unpack

    def _micro_log_probs(self, mb: TrainBatch, with_entropy: bool, rows: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [b, T], entropy [b, T] | None)`` of micro-batch ``mb``. ``rows``
        (:func:`scored_rows`): only those hidden rows go through the output layer and the softmax (the
        others, prompt positions, come back 0): the loss reads no other, and a prompt is often a sixth of
        a sample (the quickstart's five of six tokens)."""
        with exact.maybe(self.exact):  # exact: every matmul batch-invariant (backward runs outside)
            hidden, targets, unpack = self._hidden(mb)
            if rows is not None:
                rows = rows.to(hidden.device, non_blocking=True)
                whole, hidden, targets = hidden.shape[0], hidden.index_select(0, rows), targets.index_select(0, rows)
            if mb.logit_scale != 1.0:  # z / T as (h / T) W^T
                hidden = hidden * mb.logit_scale
            lp, ent = vocab_parallel_log_probs(hidden, self._output_weight(), targets,
                                               vocab_size=int(self.hf["vocab_size"]),
                                               chunk_size=self.backend.log_probs_chunk_size, with_entropy=with_entropy)
        if rows is not None:
            lp = lp.new_zeros(whole).index_copy(0, rows, lp)
            ent = ent.new_zeros(whole).index_copy(0, rows, ent) if ent is not None else None
        return unpack(lp), (unpack(ent) if ent is not None else None)

    def _micro_values(self, mb: TrainBatch) -> torch.Tensor:
        """Critic values ``[B, T]``: column ``t`` is the value of the state after token ``t - 1``,
        aligned like log-probs (the value that predicts token ``t``)."""
        hidden, _, unpack = self._hidden(mb)
        return unpack(self.value_head(hidden.float()).squeeze(-1))

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        for start, end in micro_batch_bounds(batch.lengths.tolist(), self.config.micro_batch_size,
                                             self.config.max_tokens_per_micro_batch, self._packed):
            yield batch.select(start, end)

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, with_entropy: bool = False, weights: str | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [B, T], entropy [B, T] | None)`` (fp32, CPU), 0 at column 0 and past each length.

        ``weights="ref"`` (or any :meth:`snapshot` tag) computes them with those weights swapped in.
        With DP, each replica computes its share and every rank returns the whole batch's.
        """
        batch, index = data_parallel.share(whole := batch)
        width = batch.tokens.shape[1]
        with self._weights(weights):
            self.model.eval()
            if M.pp_size() > 1:
                self._offload.start()
                results = pipeline.run(self, batch, train=False, with_entropy=with_entropy)
                lps, ents = [r["lp"] for r in results], [r["ent"] for r in results]
            else:
                lps, ents = [], []
                for host, mb in _staged(self._micro_batches(batch), self.device, self._offload):
                    with self.moe.replaying(host):  # as before staging: its lengths read without a sync
                        lp, ent = self._micro_log_probs(mb, with_entropy)
                    lps.append(lp)
                    ents.append(ent)
        lp = torch.cat([_pad(t, width) for t in lps]).cpu()
        ent = torch.cat([_pad(t, width) for t in ents]).cpu() if with_entropy else None
        return data_parallel.gather((lp, ent), index, whole)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values ``[B, T]`` (fp32, CPU) for ``role="critic"`` (DP: as :meth:`log_probs`)."""
        self.model.eval()
        part, index = data_parallel.share(batch)
        width = part.tokens.shape[1]
        staged = _staged(self._micro_batches(part), self.device, self._offload)
        values = torch.cat([_pad(self._micro_values(mb), width) for _, mb in staged]).cpu()
        return data_parallel.gather((values,), index, batch)[0]

    # ------------------------------------------------------------------ weights snapshots (reference policy)
    def snapshot(self, tag: str) -> None:
        """Keep a copy of the current weights under ``tag`` (``"ref"`` is taken at start; :mod:`.snapshots`)."""
        self._snapshots.take(tag)

    def _weights(self, tag: str | None):
        return self._snapshots.swapped_in(tag)

    # ------------------------------------------------------------------ training
    trains_with_log_probs = True  # train_step(keep_log_probs=True): the old policy's log-probs from training

    def train_step(self, batch: TrainBatch, loss_fn: Callable[..., Any] | None = None, *,
                   keep_log_probs: bool = False, **loss_kwargs: Any) -> Any:
        """One optimizer step over ``batch`` (its micro-batches); returns mean metrics.

        Actor: ``loss_fn`` as in the module docstring (extra ``loss_kwargs`` are passed through).
        Critic: clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` token-mean over the batch.
        ``keep_log_probs``: returns ``(metrics, log_probs [B, T], entropy [B, T])`` instead, the training
        forward's (weights before this step; CPU fp32, as :meth:`log_probs` returns them, but 0 off the
        response: the step scores only the rows its loss reads, :func:`scored_rows`). Where
        ``batch.old_log_probs`` is None the loss takes these (detached) as the old policy's.
        """
        from megatron.core import parallel_state

        c = self.config
        if keep_log_probs and (M.pp_size() > 1 or self.role != "actor"):  # the pipeline schedule keeps none
            kept_lp = self.log_probs(batch, with_entropy=True)
            metrics = self.train_step(batch, loss_fn, **loss_kwargs)
            return metrics, *kept_lp
        whole = batch
        batch, index = data_parallel.share(batch)
        kept: list | None = [] if keep_log_probs else None
        self.model.train()
        lr = lr_at(self.step, c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.megatron_optimizer:
            self.model.zero_grad_buffer()
        for p in ([] if self.megatron_optimizer else self._params()):
            p.grad = None
        self.optimizer.zero_grad()
        self.moe.start_stats()
        global_tokens = grads.dp_sum(float(batch.response_mask.sum()), self.device)
        global_seqs = grads.dp_sum(float(len(batch)), self.device)
        dp = parallel_state.get_data_parallel_world_size()
        # Megatron's DDP averages gradients over DP; the loss is already normalized by global counts.
        scale = dp if self.megatron_optimizer else 1.0
        totals: dict[str, float] = {}
        if M.pp_size() > 1:
            if self.role == "critic":
                raise UsageError("the critic does not support pipeline parallelism yet")
            self._offload.start()
            results = pipeline.run(self, batch, train=True, loss_fn=loss_fn, global_tokens=global_tokens,
                                     global_seqs=global_seqs, loss_kwargs=loss_kwargs, scale=scale)
            for r in results:
                totals["loss"] = totals.get("loss", 0.0) + r.pop("loss")
                size = r.pop("_n")
                for k, v in r.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * (1.0 if k in SUMMED else size / len(batch))
        micro_batches = [] if M.pp_size() > 1 else self._micro_batches(batch)
        for host, mb in _staged(micro_batches, self.device, self._offload):  # host: scored_rows without a sync
            with self.moe.replaying(mb):  # MoE: the engine's experts, forward and backward (R3)
                if self.role == "critic":
                    loss, metrics = value_loss(self._micro_values(mb), mb, c.value_clip, global_tokens)
                else:
                    rows = scored_rows(host.response_mask, host.lengths, self._packed)
                    loss, metrics = self._policy_loss(mb, loss_fn, global_tokens, global_seqs, loss_kwargs, kept,
                                                      rows)
                (loss * scale).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())  # micro-batch losses sum to the batch's
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * (1.0 if k in SUMMED else len(mb) / len(batch))
        grad_norm = self._optimizer_step()
        self.step += 1
        totals = data_parallel.reduce_metrics(totals, len(batch), global_seqs, SUMMED)
        totals.update(grad_norm=grad_norm, lr=lr, **self.moe.stats(), **self._offload.stats())
        out = totals
        if kept is not None:
            width = batch.tokens.shape[1]
            lp = torch.cat([_pad(t, width) for t, _ in kept]).cpu()
            ent = torch.cat([_pad(t, width) for _, t in kept]).cpu()
            out = (totals, *data_parallel.gather((lp, ent), index, whole))
        # due with the push (after the reads above: they would wait behind the state's copy in the copy engine)
        self._offload.after_step(self.backend.offload_parts, self.backend.offload_overlap)
        return out

    def _policy_loss(self, mb, loss_fn, global_tokens, global_seqs, loss_kwargs, kept=None, rows=None):
        c = self.config
        if loss_fn is None:
            raise UsageError("train_step: the actor needs a loss_fn")
        lp, ent = self._micro_log_probs(mb, c.entropy_coef != 0.0 or kept is not None, rows)
        if kept is not None:  # the old policy's, when this is the batch's only step (log_probs' layout)
            kept.append((lp.detach(), ent.detach()))
        return self._policy_terms(mb, lp, ent, loss_fn, global_tokens, global_seqs, loss_kwargs)

    def _policy_terms(self, mb, lp, ent, loss_fn, global_tokens, global_seqs, loss_kwargs):
        """Policy loss + KL and entropy terms (``core.losses.total_loss``, in the loss's aggregation mode)
        for micro-batch ``mb`` given its ``lp``/``ent`` ``[b, T]``. ``kl`` and ``entropy`` come back as this
        micro-batch's share of the batch value (they sum over micro-batches, like the loss)."""
        c = self.config
        old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
        loss, metrics = loss_fn(lp, old, mb.advantages, mb.response_mask, is_weights=mb.is_weights,
                                global_tokens=global_tokens, global_seqs=global_seqs, **loss_kwargs)
        metrics = {f"pg/{k}" if "/" not in k else k: v for k, v in dict(metrics or {}).items()}
        if c.kl_loss_coef and mb.ref_log_probs is None:
            raise UsageError("train_step: kl_loss_coef > 0 needs batch.ref_log_probs")
        loss_cfg = getattr(loss_fn, "config", None)
        loss, terms = total_loss(
            loss, mb.response_mask, log_probs=lp if c.kl_loss_coef else None,
            ref_log_probs=mb.ref_log_probs if c.kl_loss_coef else None, entropy=ent if c.entropy_coef else None,
            kl_loss_coef=c.kl_loss_coef, kl_kind=c.kl_kind, entropy_coef=c.entropy_coef,
            aggregation=getattr(loss_cfg, "aggregation", "token-mean"), global_tokens=global_tokens,
            global_seqs=global_seqs,
            max_response_len=getattr(loss_cfg, "max_response_len", None) or self.max_response_len)
        metrics.update({SUMMED_METRICS.get(k, k): v for k, v in terms.items() if k in SUMMED_METRICS})
        return loss, metrics

    def _optimizer_step(self) -> float:
        self._offload.ready()
        if self.megatron_optimizer:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.model])  # DP reduce + TP sum of q/k-norm grads
            _, grad_norm, _ = self.optimizer.step()
            if self.value_head is not None:
                self.head_optimizer.step()
                self.head_optimizer.zero_grad()
            return float(grad_norm or 0.0)
        params = self._params()
        self.moe.after_step()
        grads.dp_all_reduce(params)
        grads.tp_sum_partial(self.gpt, self.tp_size)
        grads.sum_tied_embedding(self.gpt, self.spec.tied(self.hf))
        norm = grads.global_norm(params, self.tp_size)
        coef = self.config.grad_clip / (norm + 1e-6) if self.config.grad_clip and norm > self.config.grad_clip else 1.0
        if self._masters is None:
            for p in params:
                if p.grad is not None and coef != 1.0:
                    p.grad.mul_(coef)
            self.optimizer.step()
            return norm
        for master, p in zip(self._masters, params):
            master.grad = None if p.grad is None else p.grad.float() * coef
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self._masters, params):
                p.copy_(master)
        return norm

    # ------------------------------------------------------------------ colocated memory
    def offload(self) -> int:
        """Weights, optimizer state and snapshots to host memory, gradients freed (``offload.HostOffload``), each
        as ``trainer.backend.offload_parts`` asks; the bytes freed. Nothing may use the model until :meth:`onload`."""
        return self._offload.offload(self.backend.offload_parts)

    def onload(self) -> int:
        """Everything :meth:`offload` moved back in place (zeroed gradients); the bytes. The optimizer's state may
        still be arriving (``offload_overlap``): what reads it first calls ``self._offload.ready()``."""
        return self._offload.onload(self.backend.offload_overlap)

    # ------------------------------------------------------------------ weights out
    def export_hf(self, bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` of at most ``bucket_bytes`` each (a larger single tensor
        gets its own bucket), TP shards gathered: a collective, call it on every TP rank. The weight push: the optimizer's
        state, offloaded, starts for host memory behind it (``offload_overlap``)."""
        self._offload.start_out()
        from posttrain.core.rollout.weight_sync import tensor_buckets

        if self.lora_modules:  # the merged weights W + s B @ A
            from posttrain.plugins.trainers.megatron.lora import hf_tensors

            return tensor_buckets(hf_tensors(self, "merged"), bucket_bytes)
        return tensor_buckets(M.iter_hf(self.model, self.spec, self.hf), bucket_bytes)

    def export_update(self, bucket_bytes: int = 1 << 30, full: bool = True,
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weight push's buckets: :meth:`export_hf` without LoRA; with it the base weights and the adapter
        pairs when ``full`` (a first push), else the pairs only (:mod:`posttrain.core.lora`)."""
        if not self.lora_modules:
            return self.export_hf(bucket_bytes)
        self._offload.start_out()
        from posttrain.core.rollout.weight_sync import tensor_buckets
        from posttrain.plugins.trainers.megatron.lora import hf_tensors

        return tensor_buckets(hf_tensors(self, "base" if full else "adapters"), bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """An HF checkpoint of the current weights (written by rank 0; tokenizer copied from the spec's path);
        with LoRA the merged weights, and ``adapter/`` in peft's format."""
        if self.lora_modules:
            from posttrain.plugins.trainers.megatron.lora import save_hf

            return save_hf(self, out_dir)
        return M.save_hf(self.model, self.spec, self.hf, out_dir, source_dir=self.spec.config.path)

    # ------------------------------------------------------------------ checkpoints (dist-checkpointing)
    def save(self, ckpt_dir: str | Path) -> None:
        """Model + optimizer + step with Megatron dist-checkpointing (torch_dist); collective."""
        self._offload.ready(writes=False)
        checkpoint.save(self, ckpt_dir)

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore what :meth:`save` wrote (same spec; TP may differ for the model weights)."""
        self._offload.ready()
        checkpoint.load(self, ckpt_dir)


def value_loss(values: torch.Tensor, mb: TrainBatch, value_clip: float, global_tokens: float):
    """Critic loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` summed over ``mb``'s response tokens, over the
    batch's ``global_tokens``; ``values`` ``[b, T]``. Returns ``(loss, {"value_loss": micro-batch token mean})``."""
    returns, mask = mb.returns, mb.response_mask
    loss_tok = (values - returns) ** 2
    if value_clip and mb.old_values is not None:
        clipped = mb.old_values + (values - mb.old_values).clamp(-value_clip, value_clip)
        loss_tok = torch.maximum(loss_tok, (clipped - returns) ** 2)
    loss = 0.5 * (loss_tok * mask).sum() / global_tokens
    return loss, {"value_loss": float(loss.detach()) * global_tokens / max(1.0, float(mask.sum()))}


def micro_batch_bounds(lengths: list[int], size: int, max_tokens: int | None = None,
                       packed: bool = True) -> list[tuple[int, int]]:
    """``[(start, end)]`` of consecutive micro-batches covering ``lengths`` (tokens per sample).

    Fixed: ``size`` samples each. By tokens (``max_tokens``, slime's ``--use-dynamic-batch-size
    --max-tokens-per-gpu``): as many consecutive samples as fit in ``max_tokens``, counted as the micro-batch
    costs, ``sum(lengths)`` packed or ``count x max(lengths)`` in padded rows; a longer sample gets a
    micro-batch of its own. The sample count is then not capped by ``size``. Order is kept, so results
    concatenate back in sample order; the losses' global counts make every split give the same step.
    """
    if not max_tokens:
        return [(s, min(s + size, len(lengths))) for s in range(0, len(lengths), size)]
    bounds, start, total, longest = [], 0, 0, 0
    for i, n in enumerate(lengths):
        if i > start and (total + n if packed else (i - start + 1) * max(longest, n)) > max_tokens:
            bounds.append((start, i))
            start, total, longest = i, 0, 0
        total, longest = total + n, max(longest, n)
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def scored_rows(response_mask: torch.Tensor, lengths: torch.Tensor, packed: bool) -> torch.Tensor:
    """Indices ``[R]`` of the hidden rows (``_hidden``'s layout: ``b * T + t`` padded, packed
    ``start_b + t``) whose next token is a response token (``response_mask[b, t + 1] > 0``): the rows
    whose log-probs a policy loss reads. Computed where the mask lives (the host, before the
    micro-batch moves), so the device never waits for a count."""
    nxt = torch.zeros(response_mask.shape, dtype=torch.bool, device=response_mask.device)
    nxt[:, :-1] = response_mask[:, 1:] > 0
    if packed:  # row-major boolean selection = each sample's first ``length`` columns, concatenated
        nxt = nxt[torch.arange(nxt.shape[1], device=nxt.device)[None, :] < lengths.to(nxt.device)[:, None]]
    return nxt.reshape(-1).nonzero().squeeze(1)


def _staged(micro_batches: Iterable[TrainBatch], device: torch.device, state: offload.TrainerOffload,
            ) -> list[tuple[TrainBatch, TrainBatch]]:
    """``(host, device)`` pairs of the micro-batches, all copied before the pass starts (a few MB), then the optimizer's
    state allowed to start back (``offload_overlap``): queued first, its 20 GB would hold these copies up."""
    staged = [(mb, mb.to(device)) for mb in micro_batches]
    state.start()
    return staged


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t
