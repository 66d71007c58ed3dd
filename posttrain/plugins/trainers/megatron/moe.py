"""The MoE side of the Megatron trainer: routing replay (R3), load-balancing metrics, expert-bias updates.

**Routing replay** (``trainer.backend.routing_replay``; slime's ``--use-rollout-routing-replay``, verl's
and NeMo-RL's R3). A MoE policy's log-prob depends on which experts each token went to; when the
trainer's router picks other experts than the engine's did (other kernels, other rounding, a router
that moved), the train/rollout log-prob gap grows far beyond a dense model's. With replay, the
engine's expert ids (``TrainBatch.routed_experts [B, T, L * k]``, from SGLang's ``routed_experts``) replace
the trainer's top-k in every MoE layer, for the log-prob passes and the train step alike: Megatron's
``RouterReplay`` (``moe_enable_routing_replay``) gathers the router's own scores at the given experts, so
the routing *weights* stay differentiable functions of the trainer's router and only the *choice* is
the engine's. Row ``t`` of a sample is the routing of token ``t``; the last token of each sample has no
row in SGLang's answer (the engine never reads it), and it takes experts ``0..k-1``: nothing the loss
reads depends on that token's MLP output (causal attention, and its own prediction is not scored).

The token order Megatron's routers see: ``[s, b]`` flattened (sequence-major) for padded micro-batches,
the packed row (samples concatenated) for packed ones. :meth:`MoERuntime.replaying` lays the expert
ids out the same way, per MoE layer of this pipeline stage.

**Metrics** (``train_step``, every micro-batch, summed over data-parallel ranks), per MoE layer ``l``
with ``c_e`` tokens routed to expert ``e`` (``T`` tokens, ``k`` experts each), mean router score
``P_e`` (softmax, or sigmoid normalized over experts)::

    moe_load_imbalance/layer_l = max_e c_e / mean_e c_e           (1.0: perfectly balanced)
    moe_aux_loss = mean_l  E * sum_e (c_e / (T k)) * P_e           (Switch load-balancing loss, coeff 1)

The aux loss is reported whatever ``moe_aux_loss_coeff`` says (0 by default in RL: the value shows
balance drifting; set ``trainer.backend.megatron.moe_aux_loss_coeff`` to train on it).

**Expert bias** (GLM's ``e_score_correction_bias``): Megatron moves it by ``moe_router_bias_update_rate``
towards balance after each step from the tokens counted in the step (``finalize_model_grads`` on GPU,
:meth:`MoERuntime.after_step` on the CPU path); the rate is 0 unless set, as in slime's GLM recipes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def moe_overrides(backend: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields the backend's own MoE keys imply (routing replay builds Megatron's
    ``RouterReplay`` into every router)."""
    return {"moe_enable_routing_replay": True} if getattr(backend, "routing_replay", False) else {}


class MoERuntime:
    """Routers of one GPTModel (this pipeline stage's MoE layers) and what the trainer does with them."""

    def __init__(self, gpt: Any, replay: bool, packed: bool, device: Any):
        self.gpt, self.config, self.packed, self.device = gpt, gpt.config, packed, device
        self.routers = [(layer.layer_number - 1, layer.mlp.router) for layer in gpt.decoder.layers
                        if hasattr(layer.mlp, "router")]
        self.replay = replay
        self._stats: dict[int, list[torch.Tensor]] | None = None
        for index, router in self.routers:
            router.register_forward_hook(self._hook(index))
            if replay and router.router_replay is None:
                raise RuntimeError("routing replay needs the model built with moe_enable_routing_replay")

    # ------------------------------------------------------------ routing replay
    def expert_ids(self, routed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``routed [b, T, L * k]`` (-1: no engine routing) -> ``[n, L, k]`` long in the token order of the
        micro-batch's forward, -1 rows replaced by experts ``0..k-1``."""
        k = self.config.moe_router_topk
        routed = routed.reshape(*routed.shape[:2], -1, k).long()
        if self.packed:
            ids = torch.cat([routed[i, :n] for i, n in enumerate(lengths.tolist())])
        else:
            ids = routed.transpose(0, 1).reshape(-1, *routed.shape[2:])
        return torch.where(ids < 0, torch.arange(k, device=ids.device), ids)

    @contextmanager
    def replaying(self, mb: Any):
        """Inside: every MoE layer routes micro-batch ``mb``'s tokens to ``mb.routed_experts`` (when replay is
        on and the batch has them; else the routers choose). Wrap forward *and* backward: recomputed
        layers route again in backward."""
        if not self.replay or getattr(mb, "routed_experts", None) is None:
            yield
            return
        self.set_targets(mb)
        try:
            yield
        finally:
            self.clear()

    def set_targets(self, mb: Any) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        ids = self.expert_ids(mb.routed_experts, mb.lengths).to(self.device)
        for layer, router in self.routers:
            router.router_replay.set_target_indices(ids[:, layer].contiguous())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        for _, router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    # ------------------------------------------------------------ metrics
    def start_stats(self) -> None:
        self._stats = {}

    def _hook(self, layer: int):
        def hook(router, inputs, outputs):
            if self._stats is None or not router.training:
                return
            with torch.no_grad():
                logits = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts).float()
                if self.config.moe_router_score_function == "softmax":
                    scores = torch.softmax(logits, dim=-1)
                else:
                    scores = torch.sigmoid(logits)
                    scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
                counts = outputs[1].reshape(logits.shape).sum(0).double()
                acc = self._stats.setdefault(layer, [torch.zeros_like(counts), torch.zeros_like(counts),
                                                     torch.zeros((), dtype=torch.float64, device=counts.device)])
                acc[0] += counts
                acc[1] += scores.sum(0).double()
                acc[2] += logits.shape[0]
        return hook

    def stats(self) -> dict[str, float]:
        """``moe_aux_loss`` and ``moe_load_imbalance/layer_<l>`` of the micro-batches since :meth:`start_stats`."""
        from megatron.core import parallel_state

        stats, self._stats = self._stats or {}, None
        if not stats:
            return {}
        layers = sorted(stats)
        packed = torch.stack([torch.cat([stats[l][0], stats[l][1], stats[l][2].reshape(1)]) for l in layers])
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(packed, group=parallel_state.get_data_parallel_group())
        experts, k = self.config.num_moe_experts, self.config.moe_router_topk
        out, aux = {}, []
        for row, layer in zip(packed.cpu(), layers):
            counts, scores, tokens = row[:experts], row[experts:2 * experts], float(row[-1])
            out[f"moe_load_imbalance/layer_{layer}"] = float(counts.max() / counts.mean().clamp(min=1e-9))
            aux.append(float(experts * ((counts / (tokens * k)) * (scores / tokens)).sum()))
        out["moe_aux_loss"] = sum(aux) / len(aux)
        out["moe_load_imbalance_max"] = max(v for n, v in out.items() if n.startswith("moe_load_imbalance/"))
        return out

    # ------------------------------------------------------------ after the optimizer step (CPU path)
    def after_step(self) -> None:
        """Move the routers' expert bias by the step's token counts (when its update rate is set) and reset
        the counts, as Megatron's ``finalize_model_grads`` does on the GPU path."""
        from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                     reset_model_temporary_tensors)

        if self.config.moe_router_enable_expert_bias and self.config.moe_router_bias_update_rate:
            _update_router_expert_bias([self.gpt], self.config)
        reset_model_temporary_tensors(self.config, [self.gpt])
