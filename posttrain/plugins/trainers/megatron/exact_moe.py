"""MoE layers of the megatron trainer in exact mode (``rollout.exact``): each layer's output is
``posttrain.core.exact.moe``, the function the local engine's MoE blocks call, over the same router logits,
the same experts and the same expert arithmetic.

:func:`install` replaces the ``forward`` of every ``MoELayer`` (all experts on this rank, ungated shared experts):
the router still runs first (its replay, forward hooks and load metrics). Under routing replay its choice,
``routing_map [tokens, E]`` (the engine's experts), is used; otherwise the experts are ``exact.choose_experts``',
the engine's own rule over the same logits. The weights are ``exact.routing_weights`` of
``exact.router_logits(x, router.weight)`` (softmax or sigmoid scores of the chosen experts, renormalized, times
the top-k scaling factor), so the router's weight still gets its gradient; the shared experts are
``exact.swiglu_expert`` of their fused ``linear_fc1`` and ``linear_fc2``, added after the routed sum. Megatron's
dispatcher, grouped GEMMs and probability scaling are bypassed (their sums run in other orders); an auxiliary
load-balancing loss is not applied.
"""

from __future__ import annotations

from posttrain.core import exact


def install(model) -> int:
    """Every MoE layer of ``model`` computes :func:`forward`; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "router") and hasattr(module, "experts"):
            _check(module)
            module.forward = ExactMoELayer(module)
            count += 1
    return count


def _check(layer) -> None:
    c = layer.config
    shared = getattr(layer, "shared_experts", None)
    why = ("experts split over ranks (ep > 1)" if len(layer.experts.local_experts) != c.num_moe_experts else
           "a gated shared expert" if shared is not None and getattr(shared, "use_shared_expert_gate", False) else
           f"{c.moe_router_score_function} routing" if c.moe_router_score_function not in ("softmax", "sigmoid")
           else None)
    if why:
        raise ValueError(f"exact mode: the MoE layer has {why}, which exact mode does not cover")


def routing_of(config) -> exact.Routing:
    """The ``exact.Routing`` of a Megatron MoE config: softmax scores renormalized unless
    ``moe_router_pre_softmax``; sigmoid scores always renormalized (the model specs refuse HF's
    ``norm_topk_prob: false`` with sigmoid routing), times ``moe_router_topk_scaling_factor``; expert groups from
    ``moe_router_num_groups``/``moe_router_group_topk``; fp32 with ``moe_router_dtype: fp32``."""
    softmax = config.moe_router_score_function == "softmax"
    return exact.Routing(top_k=config.moe_router_topk, score=config.moe_router_score_function,
                         normalize=not config.moe_router_pre_softmax if softmax else True,
                         scale=float(config.moe_router_topk_scaling_factor or 1.0),
                         groups=int(config.moe_router_num_groups or 1), group_top_k=int(config.moe_router_group_topk or 1),
                         fp32=config.moe_router_dtype == "fp32")


def _replaying(router) -> bool:
    """Whether ``router`` routes to given experts now (Megatron's ``RouterReplay`` in a replay action)."""
    replay = getattr(router, "router_replay", None)
    if replay is None or replay.router_replay_action is None:
        return False
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return replay.router_replay_action is not RouterReplayAction.RECORD


class ExactMoELayer:
    """``MoELayer.forward`` for exact mode: ``hidden [s, b, H] -> (out [s, b, H], None)``."""

    def __init__(self, layer):
        self.layer, self.routing = layer, routing_of(layer.config)

    def __call__(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        layer = self.layer
        router = layer.router
        _, routing_map = router(hidden_states)  # [s * b, E] bool: replayed or chosen
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = exact.router_logits(x, router.weight, self.routing)
        if _replaying(router):
            chosen = routing_map.bool()
        else:
            chosen = exact.chosen_mask(exact.choose_experts(logits.detach(), self.routing,
                                                            getattr(router, "expert_bias", None)), logits.shape[1])
        experts, shared = layer.experts.local_experts, getattr(layer, "shared_experts", None)
        out = exact.moe(x, exact.routing_weights(logits, chosen, self.routing), chosen,
                        lambda e, rows: exact.swiglu_expert(rows, experts[e].linear_fc1.weight,
                                                            experts[e].linear_fc2.weight),
                        None if shared is None else
                        lambda rows: exact.swiglu_expert(rows, shared.linear_fc1.weight, shared.linear_fc2.weight))
        return out.reshape(hidden_states.shape), None
