"""Pipeline parallelism for :class:`~posttrain.plugins.trainers.megatron.trainer.MegatronTrainer`: its
micro-batches through Megatron's forward-backward schedule, packed (THD), results broadcast from the last
stage so every rank returns the same tensors."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from posttrain.core.errors import UsageError
from posttrain.core.train_batch import TrainBatch, pack
from posttrain.plugins.trainers.megatron import model as M
from posttrain.plugins.trainers.megatron.logprobs import vocab_parallel_log_probs


def run(self: Any, batch: TrainBatch, *, train: bool, with_entropy: bool = False, loss_fn=None,
              global_tokens=None, global_seqs=None, loss_kwargs=None, scale: float = 1.0) -> list[dict]:
    """Run ``batch``'s micro-batches of trainer ``self`` through Megatron's pipeline schedule (1F1B when
    training).

    Returns, on every rank, the last stage's per-micro-batch results: ``{"lp", "ent"}`` ``[b, T]``
    tensors (forward only) or the loss metrics (training). Micro-batches are packed (THD).
    """
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not self.backend.sequence_packing or self.backend.attention == "local":
        raise UsageError("pipeline parallelism needs trainer.sequence_packing and a non-local attention")
    micro = list(self._micro_batches(batch))
    count = len(micro)
    need_entropy = with_entropy or (train and self.config.entropy_coef != 0.0)

    def forward_step(data_iterator, model):
        mb = next(data_iterator).to(self.device)
        if self.moe.replay and mb.routed_experts is not None:  # cleared after the schedule
            self.moe.set_targets(mb)
        p = pack(mb.tokens, mb.lengths)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                              max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len)
        psp.cu_seqlens_host = p.cu_host
        with self._hidden_only():
            out = model(p.input_ids, p.position_ids, attention_mask=None, packed_seq_params=psp)

        def loss_func(hidden):
            if mb.logit_scale != 1.0:  # the rollout's temperature: z / T as (h / T) W^T
                hidden = hidden * mb.logit_scale
            lp, ent = vocab_parallel_log_probs(
                hidden.reshape(-1, hidden.shape[-1]), self._output_weight(), p.targets,
                vocab_size=int(self.hf["vocab_size"]), chunk_size=self.backend.log_probs_chunk_size,
                with_entropy=need_entropy, recompute=self.backend.log_probs_recompute)
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
    self.moe.clear()
    group = parallel_state.get_pipeline_model_parallel_group()
    box = [list(results) if parallel_state.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, M.pp_size() - 1), group=group)
    return box[0]
