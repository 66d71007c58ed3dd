"""The local engine in exact mode (``rollout.exact``, ``rl-cli engine serve --exact``): its forward passes use
:mod:`posttrain.core.exact`'s batch-invariant arithmetic, the same the trainer uses, so the log-prob it
reports for a sampled token is the trainer's, bit for bit.

What changes in the model runner (``RunnerTuning.exact``):

- every RMSNorm of the checkpoint's modules computes ``exact.rms_norm`` and every MLP's activation
  ``exact.silu`` (:func:`adopt`); Q/K/V and gate/up stay separate matmuls;
- prefill and decode run under ``exact.mode()`` (every matmul through ``exact.bmm``'s fixed tiles) and attend
  with ``exact.attention`` (:func:`prefill_attention`, :func:`step_attention`), whose key blocks start at
  position 0 in the prefill, over the decode's cache span and in the trainer's causal pass alike;
- the sampler's log-softmax is ``exact.log_softmax`` (``sampling``; ``exact.enabled()``);
- eager only: no ``torch.compile``, fused Q/K/V, rotary-in-attention or fused sampling kernel (each would
  reorder sums or fuse ops that the trainer runs apart); no CUDA graphs (the MoE path picks each expert's rows on
  the host; a dense step's capture is not done).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from posttrain.core import exact


class ExactSiLU(torch.nn.Module):
    """``exact.silu`` as a module (an MLP's ``act_fn``)."""

    def forward(self, x):
        return exact.silu(x)


def exact_tuning(tuning):
    """``tuning`` (a ``RunnerTuning``) with the levers exact mode cannot keep turned off."""
    return replace(tuning, compile=False, cuda_graphs=False, fuse_projections=False, rope_in_attention=False,
                   decode_attention="sdpa", moe_kernel=False)


def adopt(runner) -> None:
    """Make ``runner`` (a ``ModelRunner``) exact: its model's norms and activations through
    :mod:`posttrain.core.exact`, its prefill and decode under ``exact.mode()`` with this module's attentions, and
    the process marked exact (the sampler's log-softmax)."""
    exact.enable()
    exact.patch_norms(runner.model)
    for module in runner.model.modules():
        if hasattr(module, "act_fn"):
            module.act_fn = ExactSiLU()
        if hasattr(module, "experts") and hasattr(module, "gate"):
            module.exact_moe = ExactMoE(module)
    _align_rotary(runner.model)
    runner._exact_attention, runner._exact_step_attention = prefill_attention, step_attention
    for name in ("prefill_scored", "_decode_eager"):
        setattr(runner, name, _under_mode(getattr(runner, name)))


def _align_rotary(model) -> None:
    """The rotary table recomputed on the CPU (``exact.align_inv_freq``), as the trainer's is."""
    rotary, cfg = getattr(model.model, "rotary_emb", None), model.config
    params = getattr(cfg, "rope_parameters", None) or {}
    base = getattr(cfg, "rope_theta", None) or params.get("rope_theta")
    if rotary is None or base is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return
    if exact.align_inv_freq(rotary.inv_freq, base) and isinstance(getattr(rotary, "original_inv_freq", None),
                                                                  torch.Tensor):
        rotary.original_inv_freq = rotary.inv_freq.clone()


def _under_mode(method):
    def run(*args, **kwargs):
        with exact.mode():
            return method(*args, **kwargs)

    run.__doc__ = method.__doc__
    return run


class ExactMoE:
    """A HF softmax-routed MoE block (Qwen3-MoE: ``gate.weight [E, H]``, ``gate.top_k``, ``gate.norm_topk_prob``,
    ``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``) through ``exact.moe``:
    ``x [n, q, H] -> (y [n, q, H], expert ids [n * q, k])``, the ids the trainer replays."""

    def __init__(self, block):
        if hasattr(block, "shared_experts") or hasattr(block, "shared_expert"):
            raise ValueError(f"exact mode: {type(block).__name__} has shared experts, which it does not cover")
        self.block = block

    def __call__(self, x):
        gate, experts = self.block.gate, self.block.experts
        flat = x.reshape(-1, x.shape[-1])
        logits = exact.linear(flat, gate.weight)
        ids = exact.softmax(logits).topk(gate.top_k, dim=-1).indices
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
        y = exact.moe(flat, logits, chosen,
                      lambda e, rows: exact.swiglu_expert(rows, experts.gate_up_proj[e], experts.down_proj[e]),
                      bool(getattr(gate, "norm_topk_prob", True)))
        return y.reshape(x.shape), ids


def prefill_attention(q, k, v, scale: float):
    """Causal attention of a right-padded prompt batch: ``q [n, H, P, D]``, ``k``/``v`` ``[n, Hkv, P, D]``."""
    n, _, width, _ = q.shape
    positions = torch.arange(width, device=q.device)[None, :].expand(n, width)
    return exact.attention(q, k, v, positions, scale)


def step_attention(runner, positions: torch.Tensor, span: int):
    """``attend(l, q [nb, H, 1, D], k, v [nb, Hkv, 1, D])`` of one decode step: writes the step's keys and values at
    each slot's position in layer ``l``'s cache, then ``exact.attention`` over the cache's first ``span``
    positions (keys past a slot's position add exact zeros)."""
    nb = positions.shape[0]
    rows = torch.arange(nb, device=positions.device)
    q_pos = positions[:, None]

    def attend(l, q, k, v):
        runner.k_cache[l][rows, :, positions] = k[:, :, 0]
        runner.v_cache[l][rows, :, positions] = v[:, :, 0]
        return exact.attention(q, runner.k_cache[l, :nb, :, :span], runner.v_cache[l, :nb, :, :span], q_pos,
                               runner.scaling)

    return attend
