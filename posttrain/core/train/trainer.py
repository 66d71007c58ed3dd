"""``MegatronTrainer``: the policy (or critic) model the RL loop trains, on Megatron-core.

The loop calls (shapes in :mod:`posttrain.core.train.batch`; every per-token tensor ``[B, T]``)::

    trainer = MegatronTrainer(spec, trainer_config)            # builds GPTModel (TP), loads spec's HF path
    lp, ent = trainer.log_probs(batch, with_entropy=True)      # [B, T] fp32 each; weights="ref" for reference
    metrics = trainer.train_step(batch, loss_fn)               # micro-batches, clip, LR schedule, one step
    for bucket in trainer.export_hf(bucket_bytes=1 << 30): ... # [(hf_name, tensor)], TP gathered
    trainer.save(dir); trainer.load(dir); trainer.save_hf(dir)

``loss_fn(log_probs, old_log_probs, advantages, response_mask, is_weights=None, global_tokens=None,
global_seqs=None) -> (scalar loss, metrics)`` is the Algorithms contract: micro-batch losses computed
with the whole batch's ``global_tokens``/``global_seqs`` sum to the full-batch loss. The trainer adds
``kl_loss_coef * sum(KL_k3 * mask) / global_tokens`` (against ``batch.ref_log_probs``) and subtracts
``entropy_coef * sum(H * mask) / global_tokens``.

Parallelism: TP shards inside every layer; PP (``trainer.pp``) splits the layers into stages run by
Megatron's 1F1B schedule (packed micro-batches; results are broadcast from the last stage, so every
rank returns the same tensors); ranks beyond ``tp * pp`` are data-parallel (each rank passes its own
share of the samples; losses are normalized by the global token count, gradients summed over DP).

On CPU: a torch AdamW (fp32 master weights for bf16/fp16 parameters) and our own grad clipping. On GPU: Megatron's DDP and
(distributed) optimizer. The reference policy is a CPU copy of the initial weights, swapped in for
``log_probs(..., weights="ref")`` (slime keeps such backups in the same actor too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.errors import UsageError
from posttrain.core.train import model as M
from posttrain.core.train.batch import TrainBatch, pack
from posttrain.core.train.logprobs import vocab_parallel_log_probs
from posttrain.core.train.optim import init_adam_state, use_fused_adam


def lr_at(step: int, config: Any) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then constant/linear/cosine."""
    lr = config.lr
    if config.lr_warmup_steps and step < config.lr_warmup_steps:
        return lr * (step + 1) / config.lr_warmup_steps
    if config.lr_decay_style == "constant":
        return lr
    span = max(1, config.lr_decay_steps - config.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - config.lr_warmup_steps) / span))
    if config.lr_decay_style == "linear":
        return config.min_lr + (lr - config.min_lr) * (1 - frac)
    return config.min_lr + (lr - config.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


class MegatronTrainer:
    """A Megatron-core GPTModel (policy, or critic with ``role="critic"``) with its optimizer."""

    def __init__(self, spec: Any, config: Any = None, *, seed: int = 0, role: str = "actor",
                 load_weights: bool = True):
        from posttrain.core.config import TrainerConfig

        self.spec, self.config = spec, config or TrainerConfig()
        self.role = role
        self.hf = spec.hf_config()
        self.dtype = spec.config.dtype
        overrides = M.split_megatron_overrides(self.config.megatron)
        if self.config.deterministic and torch.cuda.is_available():  # a seeded GPU run repeats (issue #24)
            from posttrain.core.train.determinism import use_deterministic_kernels

            use_deterministic_kernels()
            overrides["transformer"].setdefault("deterministic_mode", True)
        M.init_parallel(self.config.tp, self.config.pp, seed=seed)
        self.tp_rank, self.tp_size = M.tp_info()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        has_ckpt = bool(spec.config.path) and load_weights
        self.model = M.build_gpt(spec, self.hf, dtype=self.dtype, attention=self.config.attention,
                                 transformer_overrides=overrides["transformer"], init_weights=not has_ckpt,
                                 seed=seed)
        if has_ckpt:
            M.load_hf(self.model, spec, self.hf, spec.config.path)
        if self.config.compile:  # before DDP wrapping; graph breaks (packed cu_seqlens) are fine
            for layer in self.model.decoder.layers:
                layer.forward = torch.compile(layer.forward)
        self.value_head = None
        if role == "critic":  # replicated over TP, fp32; initialized to zero so initial values are 0
            self.value_head = torch.nn.Linear(self.hf["hidden_size"], 1, device=self.device, dtype=torch.float32)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        self.step = 0
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self._build_optimizer(overrides)
        if role == "actor":
            self.snapshot("ref")

    # ------------------------------------------------------------------ optimizer
    def _params(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return params + (list(self.value_head.parameters()) if self.value_head is not None else [])

    def _build_optimizer(self, overrides: dict[str, dict[str, Any]]) -> None:
        c = self.config
        self._masters: list[torch.Tensor] | None = None
        self.megatron_optimizer = torch.cuda.is_available()
        if self.megatron_optimizer:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                                                   "use_distributed_optimizer": c.use_distributed_optimizer,
                                                   **overrides["ddp"]})
            self.model = DistributedDataParallel(config=self.model.config, ddp_config=ddp, module=self.model)
            opt = OptimizerConfig(**{"optimizer": "adam", "lr": c.lr, "min_lr": c.min_lr,
                                     "weight_decay": c.weight_decay, "adam_beta1": c.adam_beta1,
                                     "adam_beta2": c.adam_beta2, "adam_eps": c.adam_eps, "clip_grad": c.grad_clip,
                                     "bf16": self.dtype == "bfloat16", "fp16": self.dtype == "float16",
                                     "params_dtype": M.DTYPES[self.dtype],
                                     "use_distributed_optimizer": c.use_distributed_optimizer,
                                     **overrides["optimizer"]})
            self.optimizer = get_megatron_optimizer(opt, [self.model])
            if c.fused_adam:
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
        return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight

    def _hidden(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(hidden [N, H], targets [N], unpack)``: one row per packed micro-batch, or padded rows."""
        tokens, lengths = mb.tokens.to(self.device), mb.lengths.to(self.device)
        width = tokens.shape[1]
        with self._hidden_only():
            if self.config.sequence_packing and self.config.attention != "local":
                from megatron.core.packed_seq_params import PackedSeqParams

                p = pack(tokens, lengths)
                psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                                      max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len)
                psp.cu_seqlens_host = p.cu_host  # read by SDPAttention: no device sync per layer
                hidden = self.model(p.input_ids, p.position_ids, attention_mask=None, packed_seq_params=psp)[0]
                return hidden, p.targets, lambda v: p.unpack(v, lengths.cpu(), width)
            positions = torch.arange(width, device=self.device).unsqueeze(0).expand_as(tokens)
            causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=self.device), 1)[None, None]
            hidden = self.model(tokens, positions, attention_mask=causal)  # [B, T, H]
        targets = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)

        def unpack(v: torch.Tensor) -> torch.Tensor:
            v = v.reshape(tokens.shape)
            out = torch.zeros_like(v)
            out[:, 1:] = v[:, :-1]
            return out * (torch.arange(width, device=v.device)[None] < lengths[:, None])

        return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), unpack

    def _micro_log_probs(self, mb: TrainBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, targets, unpack = self._hidden(mb)
        lp, ent = vocab_parallel_log_probs(hidden, self._output_weight(), targets,
                                           vocab_size=int(self.hf["vocab_size"]),
                                           chunk_size=self.config.log_probs_chunk_size, with_entropy=with_entropy)
        return unpack(lp), (unpack(ent) if ent is not None else None)

    def _micro_values(self, mb: TrainBatch) -> torch.Tensor:
        """Critic values ``[B, T]``: column ``t`` is the value of the state after token ``t - 1``,
        aligned like log-probs (the value that predicts token ``t``)."""
        hidden, _, unpack = self._hidden(mb)
        return unpack(self.value_head(hidden.float()).squeeze(-1))

    def _micro_batches(self, batch: TrainBatch, size: int | None = None) -> Iterator[TrainBatch]:
        size = size or self.config.micro_batch_size
        for start in range(0, len(batch), size):
            yield batch.select(start, min(start + size, len(batch)))

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch, *, with_entropy: bool = False, weights: str | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [B, T], entropy [B, T] | None)`` (fp32, CPU), 0 at column 0 and past each length.

        ``weights="ref"`` (or any :meth:`snapshot` tag) computes them with those weights swapped in.
        """
        with self._weights(weights):
            self.model.eval()
            if M.pp_size() > 1:
                results = self._pipeline(batch, train=False, with_entropy=with_entropy)
                width = batch.tokens.shape[1]
                lp = torch.cat([_pad(r["lp"], width) for r in results])
                return lp, (torch.cat([_pad(r["ent"], width) for r in results]) if with_entropy else None)
            lps, ents = [], []
            width = batch.tokens.shape[1]
            for mb in self._micro_batches(batch):
                lp, ent = self._micro_log_probs(mb, with_entropy)
                lps.append(_pad(lp, width))
                ents.append(_pad(ent, width) if ent is not None else None)
        return torch.cat(lps).cpu(), (torch.cat(ents).cpu() if with_entropy else None)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values ``[B, T]`` (fp32, CPU) for ``role="critic"``."""
        self.model.eval()
        width = batch.tokens.shape[1]
        return torch.cat([_pad(self._micro_values(mb), width) for mb in self._micro_batches(batch)]).cpu()

    # ------------------------------------------------------------------ weights snapshots (reference policy)
    def snapshot(self, tag: str) -> None:
        """Keep a CPU copy of the current weights under ``tag`` (``"ref"`` is taken at start)."""
        self._snapshots[tag] = {n: p.detach().to("cpu", copy=True) for n, p in M.megatron_params(self.model).items()}

    @contextmanager
    def _weights(self, tag: str | None):
        if tag is None:
            yield
            return
        if tag not in self._snapshots:
            raise UsageError(f"no weights snapshot {tag!r}; have: {', '.join(self._snapshots) or 'none'}")
        params = M.megatron_params(self.model)
        current = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._snapshots[tag][n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])

    # ------------------------------------------------------------------ training
    def _dp_sum(self, value: float) -> float:
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t.item())

    def train_step(self, batch: TrainBatch, loss_fn: Callable[..., Any] | None = None, **loss_kwargs: Any,
                   ) -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batches of ``micro_batch_size``); returns mean metrics.

        Actor: ``loss_fn`` as in the module docstring (extra ``loss_kwargs`` are passed through).
        Critic: clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` token-mean over the batch.
        """
        from megatron.core import parallel_state

        c = self.config
        self.model.train()
        lr = lr_at(self.step, c)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.megatron_optimizer:
            self.model.zero_grad_buffer()
        else:
            for p in self._params():
                p.grad = None
        self.optimizer.zero_grad()
        global_tokens = self._dp_sum(float(batch.response_mask.sum()))
        global_seqs = self._dp_sum(float(len(batch)))
        dp = parallel_state.get_data_parallel_world_size()
        # Megatron's DDP averages gradients over DP; the loss is already normalized by global counts.
        scale = dp if self.megatron_optimizer else 1.0
        totals: dict[str, float] = {}
        if M.pp_size() > 1:
            if self.role == "critic":
                raise UsageError("the critic does not support pipeline parallelism yet")
            results = self._pipeline(batch, train=True, loss_fn=loss_fn, global_tokens=global_tokens,
                                     global_seqs=global_seqs, loss_kwargs=loss_kwargs, scale=scale)
            for r in results:
                totals["loss"] = totals.get("loss", 0.0) + r.pop("loss")
                size = r.pop("_n")
                for k, v in r.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * size / len(batch)
        for mb in ([] if M.pp_size() > 1 else self._micro_batches(batch)):
            mb = mb.to(self.device)
            if self.role == "critic":
                loss, metrics = self._value_loss(mb, global_tokens)
            else:
                loss, metrics = self._policy_loss(mb, loss_fn, global_tokens, global_seqs, loss_kwargs)
            (loss * scale).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())  # micro-batch losses sum to the batch's
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * len(mb) / len(batch)
        grad_norm = self._optimizer_step()
        self.step += 1
        totals.update(grad_norm=grad_norm, lr=lr)
        return totals

    def _pipeline(self, batch: TrainBatch, *, train: bool, with_entropy: bool = False, loss_fn=None,
                  global_tokens=None, global_seqs=None, loss_kwargs=None, scale: float = 1.0) -> list[dict]:
        """Run ``batch``'s micro-batches through Megatron's pipeline schedule (1F1B when training).

        Returns, on every rank, the last stage's per-micro-batch results: ``{"lp", "ent"}`` ``[b, T]``
        tensors (forward only) or the loss metrics (training). Micro-batches are packed (THD).
        """
        from megatron.core import parallel_state
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not self.config.sequence_packing or self.config.attention == "local":
            raise UsageError("pipeline parallelism needs trainer.sequence_packing and a non-local attention")
        micro = list(self._micro_batches(batch))
        count = len(micro)
        need_entropy = with_entropy or (train and self.config.entropy_coef != 0.0)

        def forward_step(data_iterator, model):
            mb = next(data_iterator).to(self.device)
            p = pack(mb.tokens, mb.lengths)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                                  max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len)
            psp.cu_seqlens_host = p.cu_host
            with self._hidden_only():
                out = model(p.input_ids, p.position_ids, attention_mask=None, packed_seq_params=psp)

            def loss_func(hidden):
                lp, ent = vocab_parallel_log_probs(
                    hidden.reshape(-1, hidden.shape[-1]), self._output_weight(), p.targets,
                    vocab_size=int(self.hf["vocab_size"]), chunk_size=self.config.log_probs_chunk_size,
                    with_entropy=need_entropy, recompute=self.config.log_probs_recompute)
                width = mb.tokens.shape[1]
                lp = p.unpack(lp, mb.lengths.cpu(), width)
                ent = p.unpack(ent, mb.lengths.cpu(), width) if ent is not None else None
                if not train:
                    return lp.sum() * 0, {"lp": lp.detach().cpu(), "ent": None if ent is None else ent.detach().cpu()}
                loss, metrics = self._policy_terms(mb, lp, ent, loss_fn, global_tokens, global_seqs, loss_kwargs)
                # the schedule divides by the number of micro-batches; ours already sum to the batch loss
                return loss * count * scale, {"loss": float(loss.detach()), "_n": len(mb), **metrics}

            return out, loss_func

        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
            num_microbatches=count, seq_length=max(int(mb.lengths.sum()) for mb in micro), micro_batch_size=1,
            forward_only=not train)
        group = parallel_state.get_pipeline_model_parallel_group()
        box = [list(results) if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, M.pp_size() - 1), group=group)
        return box[0]

    def _policy_loss(self, mb, loss_fn, global_tokens, global_seqs, loss_kwargs):
        c = self.config
        if loss_fn is None:
            raise UsageError("train_step: the actor needs a loss_fn")
        lp, ent = self._micro_log_probs(mb, c.entropy_coef != 0.0)
        return self._policy_terms(mb, lp, ent, loss_fn, global_tokens, global_seqs, loss_kwargs)

    def _policy_terms(self, mb, lp, ent, loss_fn, global_tokens, global_seqs, loss_kwargs):
        """Policy loss + KL and entropy terms for micro-batch ``mb`` given its ``lp``/``ent`` ``[b, T]``."""
        c = self.config
        need_entropy = c.entropy_coef != 0.0
        old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
        loss, metrics = loss_fn(lp, old, mb.advantages, mb.response_mask, is_weights=mb.is_weights,
                                global_tokens=global_tokens, global_seqs=global_seqs, **loss_kwargs)
        metrics = {f"pg/{k}" if "/" not in k else k: v for k, v in dict(metrics or {}).items()}
        mask = mb.response_mask
        if c.kl_loss_coef:
            if mb.ref_log_probs is None:
                raise UsageError("train_step: kl_loss_coef > 0 needs batch.ref_log_probs")
            from posttrain.core.losses import kl_divergence

            kl = (kl_divergence(lp, mb.ref_log_probs, kind=c.kl_kind) * mask).sum() / global_tokens
            loss = loss + c.kl_loss_coef * kl
            metrics["kl"] = float(kl.detach()) * global_tokens / max(1.0, float(mask.sum()))
        if need_entropy:
            entropy = (ent * mask).sum() / global_tokens
            loss = loss - c.entropy_coef * entropy
            metrics["entropy"] = float(entropy.detach()) * global_tokens / max(1.0, float(mask.sum()))
        return loss, metrics

    def _value_loss(self, mb: TrainBatch, global_tokens: float):
        values = self._micro_values(mb)
        returns, mask = mb.returns, mb.response_mask
        loss_tok = (values - returns) ** 2
        if self.config.value_clip and mb.old_values is not None:
            clipped = mb.old_values + (values - mb.old_values).clamp(-self.config.value_clip, self.config.value_clip)
            loss_tok = torch.maximum(loss_tok, (clipped - returns) ** 2)
        loss = 0.5 * (loss_tok * mask).sum() / global_tokens
        return loss, {"value_loss": float(loss.detach()) * global_tokens / max(1.0, float(mask.sum()))}

    def _optimizer_step(self) -> float:
        if self.megatron_optimizer:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.model])  # DP reduce + TP sum of q/k-norm grads
            _, grad_norm, _ = self.optimizer.step()
            if self.value_head is not None:
                self.head_optimizer.step()
                self.head_optimizer.zero_grad()
            return float(grad_norm or 0.0)
        self._dp_all_reduce_grads()
        self._tp_sum_partial_grads()
        self._sum_tied_embedding_grads()
        norm = self._grad_norm()
        coef = self.config.grad_clip / (norm + 1e-6) if self.config.grad_clip and norm > self.config.grad_clip else 1.0
        if self._masters is None:
            for p in self._params():
                if p.grad is not None and coef != 1.0:
                    p.grad.mul_(coef)
            self.optimizer.step()
            return norm
        params = self._params()
        for master, p in zip(self._masters, params):
            master.grad = None if p.grad is None else p.grad.float() * coef
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self._masters, params):
                p.copy_(master)
        return norm

    def _dp_all_reduce_grads(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() == 1:
            return
        for p in self._params():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())

    def _tp_sum_partial_grads(self) -> None:
        """Replicated parameters that each TP rank applies to its own heads only (per-head q/k norms)
        get a partial gradient per rank: sum them, as Megatron's ``finalize_model_grads`` does."""
        from megatron.core import parallel_state

        if self.tp_size == 1:
            return
        for name, p in self.gpt.named_parameters():
            if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())

    def _sum_tied_embedding_grads(self) -> None:
        """With PP and tied embeddings the first and last stage each hold a copy: sum their gradients."""
        from megatron.core import parallel_state

        if M.pp_size() == 1 or not self.spec.tied(self.hf) or not parallel_state.is_rank_in_embedding_group():
            return
        weight = self.gpt.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _grad_norm(self) -> float:
        """Global L2 norm: TP-sharded grads summed over TP ranks, replicated ones counted once."""
        from megatron.core import parallel_state

        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        last_stage_copy = M.pp_size() > 1 and not parallel_state.is_pipeline_first_stage()
        for p in self._params():
            if p.grad is None or (last_stage_copy and getattr(p, "shared_embedding", False)):
                continue  # a tied output layer's grad equals the embedding's: count it once
            sq = p.grad.detach().double().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        total = sharded + replicated
        if M.pp_size() > 1:  # each stage holds different parameters
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return float(total.sqrt())

    # ------------------------------------------------------------------ weights out
    def export_hf(self, bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of ``(hf_name, full tensor)`` of at most ``bucket_bytes`` each (a larger single tensor
        gets its own bucket), TP shards gathered: a collective, call it on every TP rank."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in M.iter_hf(self.model, self.spec, self.hf):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """An HF checkpoint of the current weights (written by rank 0; tokenizer copied from the spec's path)."""
        return M.save_hf(self.model, self.spec, self.hf, out_dir, source_dir=self.spec.config.path)

    # ------------------------------------------------------------------ checkpoints (dist-checkpointing)
    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        model_sd = self.gpt.sharded_state_dict(prefix="model.")
        state: dict[str, Any] = {"model": model_sd, "step": self.step}
        if self.value_head is not None:
            state["value_head"] = {k: v.detach().cpu() for k, v in self.value_head.state_dict().items()}
        if self.megatron_optimizer:
            # dp_reshardable: each rank saves its own optimizer shards, in parallel. Megatron-core 0.16's
            # default (fully_sharded_model_space) builds flattened ShardedTensors that its own checker
            # refuses ("ShardedTensor.flattened_range is not supported").
            # Without TE/Apex, Megatron reads the step from torch's AdamW state, which exists only after a
            # first step: a fresh trainer loading a checkpoint needs it made. Megatron's distributed
            # optimizer (0.16, dp_reshardable) restores the moments but not that step counter (measured on
            # an H200: 0 after load), so it travels beside them as "adam_steps".
            adams = self._torch_adams()
            for adam in adams:
                init_adam_state(adam)
            state["adam_steps"] = [max((float(st["step"]) for st in adam.state.values()), default=0.0)
                                   for adam in adams]
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
            return state
        # Every parameter gets a state, also those without gradients so far (the critic never uses the
        # output layer), so saved and loading structures agree.
        init_adam_state(self.optimizer)
        optim = self.optimizer.state_dict()
        optim["state"] = {pid: dict(s) for pid, s in optim["state"].items()}  # torch shares the live dicts
        gpt_params = [p for p in self.gpt.parameters() if p.requires_grad]
        id_map = get_param_id_to_sharded_param_map(model_sd, gpt_params)
        head_ids = set(range(len(gpt_params), len(self._params())))  # the critic's replicated fp32 head
        if head_ids:  # plain tensors in the common part, not sharded
            state["value_head_optimizer"] = {pid: {k: v.detach().cpu().clone() for k, v in optim["state"][pid].items()}
                                             for pid in head_ids if pid in optim["state"]}
            optim["state"] = {pid: st for pid, st in optim["state"].items() if pid not in head_ids}
        steps = {pid: st.pop("step") for pid, st in optim["state"].items() if "step" in st}
        if self._masters is not None:  # fp32 master weights travel sharded like the moments
            for pid, master in enumerate(self._masters[: len(gpt_params)]):
                optim["state"].setdefault(pid, {})["master_param"] = master.detach()
        optim_state_to_sharding_state(optim, id_map)
        optim.pop("param_groups")  # ids differ per pipeline stage: rebuilt from the live optimizer on load
        state["optimizer"] = optim
        state["optimizer_step"] = max((float(v) for v in steps.values()), default=0.0)
        return state

    def _torch_adams(self) -> list[torch.optim.Optimizer]:
        """The torch Adam(W) instances inside Megatron's (chained) optimizer."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        inners = [getattr(o, "optimizer", None) for o in chained]
        return [o for o in inners if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]

    def save(self, ckpt_dir: str | Path) -> None:
        """Model + optimizer + step with Megatron dist-checkpointing (torch_dist); collective."""
        from megatron.core import dist_checkpointing

        path = Path(ckpt_dir)
        if not dist.is_initialized() or dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(path))

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore what :meth:`save` wrote (same spec; TP may differ for the model weights)."""
        from megatron.core import dist_checkpointing

        if not Path(ckpt_dir).is_dir():
            raise UsageError(f"{ckpt_dir}: no such checkpoint directory")
        loaded = dist_checkpointing.load(self._sharded_state(is_loading=True), str(ckpt_dir))
        model_sd = {k.removeprefix("model."): v for k, v in loaded["model"].items()}
        result = self.gpt.load_state_dict(model_sd, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise UsageError(f"{ckpt_dir}: checkpoint lacks {missing[:3]} (written by another model spec?)")
        self.step = int(loaded["step"])
        if self.value_head is not None:
            self.value_head.load_state_dict(loaded["value_head"])
        if self.megatron_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
            for adam, step in zip(self._torch_adams(), loaded.get("adam_steps", [])):
                for st in adam.state.values():
                    st["step"] = torch.full_like(st["step"], step) if torch.is_tensor(st["step"]) else step
            return
        optim = loaded["optimizer"]
        optim["param_groups"] = self.optimizer.state_dict()["param_groups"]
        step = torch.tensor(loaded["optimizer_step"])
        if self._masters is not None:
            with torch.no_grad():
                for pid, master in enumerate(self._masters):
                    saved = optim["state"].get(pid, {}).pop("master_param", None)
                    params = self._params()
                    master.copy_(saved if saved is not None else params[pid].detach().float())
        for pid in optim["state"]:
            optim["state"][pid]["step"] = step.clone()
        for pid, s in (loaded.get("value_head_optimizer") or {}).items():
            optim["state"][pid] = s
        self.optimizer.load_state_dict(optim)


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t
