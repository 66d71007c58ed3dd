"""MoE layers of the megatron trainer in exact mode (``rollout.exact``): each layer's output is
``posttrain.core.exact.moe``, the function the local engine's MoE blocks call, over the same router logits,
the experts its router chose (under routing replay, the engine's) and the same expert arithmetic.

:func:`install` replaces the ``forward`` of every ``MoELayer`` (softmax routing, no shared experts, all experts on
this rank): the router still runs first (its replay, forward hooks and load metrics), and only its choice,
``routing_map [tokens, E]``, is used; the weights are ``exact.moe``'s, a function of
``exact.linear(x, router.weight)``, so the router's weight still gets its gradient. Megatron's dispatcher,
grouped GEMMs and probability scaling are bypassed (their sums run in other orders); an auxiliary load-balancing
loss is not applied.
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
    why = ("sigmoid routing" if c.moe_router_score_function != "softmax" else
           "shared experts" if getattr(layer, "shared_experts", None) is not None else
           "experts split over ranks (ep > 1)" if len(layer.experts.local_experts) != c.num_moe_experts else
           "a top-k scaling factor" if c.moe_router_topk_scaling_factor not in (None, 1.0) else None)
    if why:
        raise ValueError(f"exact mode: the MoE layer has {why}, which exact mode does not cover")


class ExactMoELayer:
    """``MoELayer.forward`` for exact mode: ``hidden [s, b, H] -> (out [s, b, H], None)``."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        layer = self.layer
        _, routing_map = layer.router(hidden_states)  # [s * b, E] bool: replayed or chosen
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = exact.linear(x, layer.router.weight)
        experts = layer.experts.local_experts
        out = exact.moe(x, logits, routing_map.bool(),
                        lambda e, rows: exact.swiglu_expert(rows, experts[e].linear_fc1.weight,
                                                            experts[e].linear_fc2.weight),
                        not layer.config.moe_router_pre_softmax)
        return out.reshape(hidden_states.shape), None
