"""The local engine in exact mode (``rollout.exact``, ``rl-cli engine serve --exact``): its forward passes use
:mod:`posttrain.core.exact`'s batch-invariant arithmetic, the same the trainer uses, so the log-prob it
reports for a sampled token is the trainer's, bit for bit.

What changes in the model runner (``RunnerTuning.exact``):

- every RMSNorm of the checkpoint's modules computes ``exact.rms_norm`` and every MLP's activation
  ``exact.silu`` (:func:`adopt`; config validation refuses other activations); Q/K/V and gate/up stay separate
  matmuls; MoE blocks run through :class:`ExactMoE` (``exact.moe``); multi-head latent attention through
  :class:`ExactLatentAttention` (keys and values expanded from the latent cache, not absorbed);
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
from posttrain.plugins.engines.local.layers import finish_layer
from posttrain.plugins.engines.local.mla import LatentAttention


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
        for attr in ("act_fn", "activation_fn"):  # Llama's, Qwen's and GLM-4's MLPs name it differently
            if hasattr(module, attr):
                setattr(module, attr, ExactSiLU())
        if hasattr(module, "experts") and hasattr(module, "gate"):
            module.exact_moe = ExactMoE(module)
    _align_rotary(runner.model)
    runner._exact_attention, runner._exact_step_attention = prefill_attention, step_attention
    if getattr(runner, "mla", None) is not None:  # after mla.adopt_latent_attention: its cache, expanded
        runner.mla = ExactLatentAttention(runner.model)
        runner._prefill_parts = (runner.mla.project_qkv, runner.mla.finish)
        runner._exact_attention = runner.mla.prefill_attention
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
    """A HF MoE block through ``exact.moe``: ``x [n, q, H] -> (y [n, q, H], expert ids [n * q, k])``, the ids the
    trainer replays. The block's parts (transformers' Qwen3-MoE, GLM-4.5 and DeepSeek-V3 blocks):
    ``gate.weight [E, H]``, ``gate.top_k``, ``gate.norm_topk_prob``; a sigmoid router also has
    ``gate.e_score_correction_bias [E]`` (steers the choice), ``gate.routed_scaling_factor`` and
    ``gate.num_group``/``gate.topk_group``; ``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``;
    ungated ``shared_experts`` (a SwiGLU MLP: ``exact.swiglu`` of its ``gate_proj``, ``up_proj``, ``down_proj``).

    The routing is read from the gate's attributes (:func:`routing_of`) and checked against the gate's own
    weights on a probe batch: a router that weighs its experts otherwise is refused by name."""

    def __init__(self, block):
        if hasattr(block, "shared_expert_gate") or hasattr(block, "shared_expert"):  # Qwen2-MoE's, gated
            raise ValueError(f"exact mode: {type(block).__name__} gates its shared expert, which it does not cover")
        self.block, self.routing = block, routing_of(block.gate)
        self.bias = getattr(block.gate, "e_score_correction_bias", None)
        shared = getattr(block, "shared_experts", None)
        self.shared = None if shared is None else _shared_swiglu(shared, type(block).__name__)
        why = _routing_mismatch(block.gate, self.routing)
        if why:
            raise ValueError(f"exact mode: the router of {type(block).__name__} {why}, which exact mode does not cover")

    def __call__(self, x):
        gate, experts = self.block.gate, self.block.experts
        flat = x.reshape(-1, x.shape[-1])
        logits = exact.router_logits(flat, gate.weight, self.routing)
        ids = exact.choose_experts(logits, self.routing, self.bias)
        chosen = exact.chosen_mask(ids, logits.shape[1])
        y = exact.moe(flat, exact.routing_weights(logits, chosen, self.routing), chosen,
                      lambda e, rows: exact.swiglu_expert(rows, experts.gate_up_proj[e], experts.down_proj[e]),
                      self.shared)
        return y.reshape(x.shape), ids


def _shared_swiglu(mlp, block: str):
    """``rows -> exact.swiglu(rows, gate_proj, up_proj, down_proj)`` of a HF shared-experts MLP."""
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(not isinstance(p, torch.nn.Linear) or p.bias is not None for p in parts):
        raise ValueError(f"exact mode: the shared experts of {block} are not a SwiGLU MLP without biases "
                         "(gate_proj, up_proj, down_proj), which exact mode does not cover")
    return lambda rows: exact.swiglu(rows, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def routing_of(gate) -> exact.Routing:
    """The ``exact.Routing`` of a HF router module: sigmoid scores where it has an ``e_score_correction_bias``
    (GLM-4.5's and DeepSeek-V3's routers, which also run in fp32), else softmax (Qwen3-MoE's, in the model's
    dtype)."""
    sigmoid = hasattr(gate, "e_score_correction_bias")
    return exact.Routing(top_k=int(gate.top_k), score="sigmoid" if sigmoid else "softmax",
                         normalize=bool(getattr(gate, "norm_topk_prob", True)),
                         scale=float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0),
                         groups=int(getattr(gate, "num_group", 1) or 1), group_top_k=int(getattr(gate, "topk_group", 1) or 1),
                         fp32=sigmoid)


@torch.no_grad()
def _routing_mismatch(gate, routing: exact.Routing) -> str | None:
    """Why ``gate``'s own weights of its chosen experts are not ``exact.routing_weights`` (to 1e-2 relative) on 16
    random tokens, or None: ``gate(x) -> (logits, weights [m, k], ids [m, k])``, HF's router contract."""
    weight = gate.weight
    x = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    try:
        logits, want, ids = gate(x)
    except Exception as exc:  # noqa: BLE001 - a router of another contract is a refusal, not a crash
        return f"does not answer (logits, weights, ids) ({exc!r})"
    chosen = exact.chosen_mask(ids, weight.shape[0])
    got = exact.routing_weights(exact.router_logits(x, weight, routing), chosen, routing).gather(1, ids)
    if not torch.allclose(got, want.float(), rtol=1e-2, atol=1e-6):
        return f"weighs its experts otherwise than {routing}"
    return None


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


class ExactLatentAttention(LatentAttention):
    """Multi-head latent attention in exact mode, the trainer's way (Megatron's ``MLASelfAttention``): the cache
    keeps ``mla``'s latent rows ``[rms(ckv) ; rope(k_r)]``, but no up-projection is absorbed into the query or the
    output. Keys and values are expanded from the rows of the whole span at every pass::

        [k_nope ; v] = kv_b_proj(rows[:, :c])  per head,   k = [k_nope ; rope(k_r)],   q = [q_nope ; rope(q_r)]
        o = exact.attention(q, k, v)                                       # [n, H, q, d_v], then o_proj

    A row's keys and values are one tile product of its latent, whatever the span, as the trainer's
    ``linear_kv_up_proj`` over the sequence gives them."""

    def __init__(self, model):
        super().__init__(model)
        self._layer = None  # the layer whose rows the prefill's attention expands (project_qkv sets it)

    def project(self, layer, h, cos, sin):
        """``h [n, q, hidden]`` -> ``(q [n, H, q, d_n + r], rows [n, q, c + r])``."""
        attn = layer.self_attn
        n, q_len, _ = h.shape
        x = layer.input_layernorm(h)
        q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q_nope, q_r = q.view(n, q_len, self.heads, self.nope + self.rope_dim).transpose(1, 2).split(
            [self.nope, self.rope_dim], dim=-1)
        latent, k_r = attn.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q_r, k_r = self._rope(q_r, k_r[:, None], cos, sin)
        return torch.cat([q_nope, q_r], dim=-1), torch.cat([attn.kv_a_layernorm(latent), k_r[:, 0]], dim=-1)

    def expand(self, layer, rows):
        """Latent rows ``[n, S, c + r]`` -> keys ``[n, H, S, d_n + r]`` and values ``[n, H, S, d_v]``."""
        n, span, _ = rows.shape
        kv = exact.linear(rows[..., :self.rank], layer.self_attn.kv_b_proj.weight)
        k_nope, v = kv.view(n, span, self.heads, self.nope + self.v_dim).transpose(1, 2).split(
            [self.nope, self.v_dim], dim=-1)
        k_r = rows[:, None, :, self.rank:].expand(n, self.heads, span, self.rope_dim)
        return torch.cat([k_nope, k_r], dim=-1), v

    def project_qkv(self, layer, h, cos, sin, rope=None, qkv=None):
        """The prefill's parts: ``(q, rows [n, 1, P, c + r], rows[..., :c])``, the cache's layout."""
        q, rows = self.project(layer, h, cos, sin)
        self._layer = layer
        return q, rows[:, None], rows[:, None, :, :self.rank]

    def prefill_attention(self, q, k, v, scale: float):
        """``exact.attention`` of the prompt rows ``k [n, 1, P, c + r]`` (``v``: their view) -> ``[n, H, P, d_v]``."""
        keys, values = self.expand(self._layer, k[:, 0])
        return prefill_attention(q, keys, values, scale)

    def finish(self, layer, h, o, gate_up=None):
        return finish_layer(layer, h, o, gate_up)

    def decode(self, layer, h, cos, sin, scaling, cache, positions, span):
        """One token per slot: its row into ``cache [N, 1, S_max, c + r]`` at its position, then ``exact.attention``
        over the span's expanded rows (keys past a slot's position add exact zeros) -> ``[nb, H, 1, d_v]``."""
        nb = h.shape[0]
        q, rows = self.project(layer, h, cos, sin)
        cache[torch.arange(nb, device=h.device), 0, positions] = rows[:, 0].to(cache.dtype)
        keys, values = self.expand(layer, cache[:nb, 0, :span])
        return exact.attention(q, keys, values, positions[:, None], scaling)
